"""What runs inside each torchrun process group: one benchmark row per launch."""
