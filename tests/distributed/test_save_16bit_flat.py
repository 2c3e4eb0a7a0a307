"""`save_16bit_model` at stages 0-2 writes every tensor: the parameters are views of one flat buffer, and the file
deduplicated tied weights by storage, so it held one tensor of the whole model (a GPT: 1 of 28). Its default file is
DeepSpeed's `pytorch_model.bin` (torch.save; it wrote safetensors under any name)."""

from __future__ import annotations

import os

import torch

from helpers.harness import run_on_ranks
from helpers.parity import TINY


def _save(rank: int, world_size: int, folder: str) -> dict[int, dict[str, torch.Tensor]]:
    import zeroshard
    from zeroshard.models.gpt import GPT

    zeroshard.init_distributed()
    out = {}
    for stage in (0, 1, 2):
        torch.manual_seed(0)
        model = GPT(TINY)  # its lm_head is tied to the token embedding
        model.wpe.requires_grad_(stage != 2)  # frozen at stage 2: exclude_frozen_parameters leaves it out
        config = {"train_batch_size": 2 * world_size, "train_micro_batch_size_per_gpu": 2}
        config |= {"zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
        engine, *_ = zeroshard.initialize(model=model, config=config)
        x = torch.randint(0, TINY.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))
        engine.backward(engine(x, x))
        engine.step()
        engine.save_16bit_model(os.path.join(folder, str(stage)), "model.safetensors")
        engine.save_16bit_model(os.path.join(folder, str(stage)))  # DeepSpeed's default name and format
        engine.save_16bit_model(os.path.join(folder, str(stage)), "trained.pt", exclude_frozen_parameters=True)
        out[stage] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def test_save_16bit_model_writes_every_tensor_at_stages_0_to_2(tmp_path) -> None:
    from safetensors.torch import load_file

    from zeroshard.models.gpt import GPT

    trained = run_on_ranks(_save, 2, str(tmp_path), timeout=300)[0]
    for stage, state in trained.items():
        saved = load_file(os.path.join(tmp_path, str(stage), "model.safetensors"))
        assert len(saved) == len(state) - 1, (stage, sorted(saved))  # the tied head once
        fresh = GPT(TINY)
        fresh.load_state_dict(saved, strict=False)
        for name, value in fresh.state_dict().items():
            assert torch.equal(value, state[name]), (stage, name)
        pickled = torch.load(os.path.join(tmp_path, str(stage), "pytorch_model.bin"), weights_only=True)
        assert pickled.keys() == state.keys() and all(torch.equal(pickled[k], v) for k, v in state.items())
        assert pickled["lm_head.weight"] is pickled["wte.weight"]  # tied: one tensor under both names, as saved
        stored = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in pickled.values()}.values())
        assert stored == sum(t.numel() * t.element_size() for t in saved.values())  # no flat buffer behind a view
        trained_only = torch.load(os.path.join(tmp_path, str(stage), "trained.pt"), weights_only=True)
        assert set(state) - set(trained_only) == ({"wpe.weight"} if stage == 2 else set()), stage
