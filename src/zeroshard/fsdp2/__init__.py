"""The fsdp2 backend: the same config, engine API and checkpoints on PyTorch FSDP2 (`"zeroshard": {"backend":
"fsdp2"}`). See docs/fsdp2.md and [Note: fsdp2 mapping].

Imported by module (`zeroshard.fsdp2.plan`, `.build`): `import zeroshard` loads none of torch's FSDP2 internals,
which the backend needs from torch 2.8 on.
"""
