"""Side-by-side benchmarks of zeroshard against DDP, FSDP2 and DeepSpeed (`python -m benchmarks.run`)."""
