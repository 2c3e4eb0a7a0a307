"""`zeroshard validate-config`, the ds_config presets, `zeroshard report`, and train's argument checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from zeroshard.cli.main import main
from zeroshard.config import parse_config, resolve_config
from zeroshard.integrations.ds_config import TrainHyper, train_ds_config
from zeroshard.presets import DS_CONFIG_PRESETS, fill_auto

DS_CONFIGS = sorted((Path(__file__).parent / "data" / "ds_configs").glob("*.json"))
HYPER = TrainHyper(
    micro_batch=4,
    grad_accum=2,
    lr=3e-4,
    weight_decay=0.1,
    warmup_steps=5,
    max_steps=50,
    max_grad_norm=1.0,
    dtype="bf16",
)


@pytest.mark.parametrize("path", DS_CONFIGS, ids=lambda p: p.stem)
def test_validate_config_accepts_the_real_configs(path, capsys):
    assert main(["validate-config", str(path), "--world-size", "2", "--hidden-size", "64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{path}: valid for world size 2")
    resolved = json.loads(out[out.index("{") :])
    assert resolved["zero_optimization"]["stage"] in (2, 3)


def test_validate_config_lists_unimplemented_and_deprecated_keys(capsys):
    path = next(p for p in DS_CONFIGS if p.stem == "transformers-tests_zero3")
    assert main(["validate-config", str(path)]) == 0
    out = capsys.readouterr().out
    warnings = out[out.index("warnings:") : out.index("resolved config")]
    assert "stage3_gather_fp16_weights_on_model_save is deprecated" in warnings
    assert "is accepted but not implemented" not in warnings  # offload (cpu) is implemented now


def test_validate_config_strict_and_set(capsys):
    path = next(p for p in DS_CONFIGS if p.stem == "ms-swift_zero2_offload")
    assert main(["validate-config", str(path), "--strict"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'optimizer.params.lr is "auto"' in err and "--set" in err
    sets = [
        "--set",
        "optimizer.params.lr=1e-4",
        "--set",
        "scheduler.params.total_num_steps=100",
        "--set",
        "train_micro_batch_size_per_gpu=2",
        "--set",
        "gradient_accumulation_steps=4",
    ]
    assert main(["validate-config", str(path), "--strict", "--json", "--world-size", "2", *sets]) == 0
    resolved = json.loads(capsys.readouterr().out)
    assert resolved["train_batch_size"] == 16 and resolved["optimizer"]["params"]["lr"] == 1e-4
    # a key --set does not fill (a typo, a key the file sets) was dropped without a word: refused, naming the autos
    for given in ("optimizer.params.lrr=1e-4", "zero_optimization.stage=1"):
        assert main(["validate-config", str(path), "--set", given]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f'--set {given.split("=")[0]}: not an "auto" key of' in err, err
        assert "optimizer.params.lr" in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            {"zero_optimization": {"stage": 2, "overlap_com": True}},
            "overlap_com: unknown key; did you mean overlap_comm?",
        ),
        (
            {"train_batch_size": 33, "train_micro_batch_size_per_gpu": 17, "gradient_accumulation_steps": 2},
            "train_batch_size 33 != ",
        ),
        ("{not json", "is not valid JSON"),
    ],
)
def test_validate_config_errors_exit_2_with_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "ds.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    assert main(["validate-config", str(path), "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert main(["validate-config", str(tmp_path / "missing.json")]) == 2


@pytest.mark.parametrize("name", sorted(DS_CONFIG_PRESETS))
def test_presets_resolve_with_train_values(name):
    config = train_ds_config(name, HYPER, world_size=2)
    cfg = resolve_config(parse_config(config), world_size=2, known={"hidden_size": 64})
    assert cfg.train_batch_size == 16 and cfg.gradient_accumulation_steps == 2
    assert cfg.optimizer.params["lr"] == 3e-4 and cfg.scheduler.params["total_num_steps"] == 50
    assert cfg.bf16.enabled and not cfg.fp16.enabled
    assert cfg.zero_optimization.stage == int(name[4])


def test_fill_auto_keeps_explicit_values_and_aliases():
    config = {"bfloat16": {"enabled": "auto"}, "train_batch_size": 32, "optimizer": {"params": {"lr": 0.1}}}
    filled = fill_auto(config, {"bf16.enabled": True, "optimizer.params.lr": 1.0, "train_micro_batch_size_per_gpu": 4})
    assert filled["bfloat16"]["enabled"] is True and filled["optimizer"]["params"]["lr"] == 0.1
    assert "train_micro_batch_size_per_gpu" not in filled  # the config fixed the batch size itself
    assert fill_auto({}, {"train_micro_batch_size_per_gpu": 4})["train_micro_batch_size_per_gpu"] == 4


def test_report_runs_and_checks_o_direct(tmp_path, capsys):
    assert main(["report", "--nvme-path", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"versions", "backends", "devices", "pinned memory", "nvme / async io"}
    names = {c["name"]: c for c in report["versions"]}
    assert names["torch"]["ok"] and "deepspeed" in names
    assert any(c["name"] == "backend gloo" and c["ok"] for c in report["backends"])
    assert any(c["name"] == "O_DIRECT writes" for c in report["nvme / async io"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "./no/such/folder"], "model folder does not exist"),
        (["--model", "no-such-model"], "is not a built-in model config"),
        (["--data", "/no/such/data.txt"], "dataset /no/such/data.txt does not exist"),
        (["--ds-config", "/no/such/ds.json"], "is neither a file nor a preset"),
        (["--zero-stage", "1", "--offload"], "--offload needs --zero-stage 2 or 3"),
        (["--micro-batch", "0"], "--micro-batch 0 must be >= 1"),
        (["--max-restarts", "2"], "--max-restarts 2 needs --save-steps N"),
    ],
)
def test_train_rejects_bad_inputs_before_starting(capsys, args, message):
    code = main(["train", "--nproc-per-node", "2", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err and "Traceback" not in err  # (bad input: exit 2)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"zero_optimization": {"stage": 2, "overlap_com": True}}, "overlap_com: unknown key"),
        # the command ends its windows itself ([Note: caller-owned windows])
        ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation is false, but zeroshard train"),
    ],
)
def test_train_rejects_a_bad_ds_config(tmp_path, capsys, config, message):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    assert main(["train", "--ds-config", str(path), "--output-dir", str(tmp_path / "out" / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()  # the writable check's folders go again (an empty one was left)


def test_train_refuses_an_unwritable_output_dir_before_starting(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code = main(["train", "--nproc-per-node", "2", "--output-dir", str(blocker / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"--output-dir {blocker / 'out'}: cannot write there" in err[0]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"text": "fine"}\n{"text": 1}\n', "line 2: no string field 'text'"),
        (b'{"text": "fine"}\nnot json\n', "line 2: not JSON"),
        (b"\xff\xfe not utf-8", "is not UTF-8 text"),
    ],
)
def test_train_reads_the_datasets_contents_before_starting_the_ranks(tmp_path, capsys, content, message):
    """A bad line was found by every rank after it started (a failure report from the launched job, not one line)."""
    data = tmp_path / ("data.jsonl" if content.startswith(b"{") else "data.txt")
    data.write_bytes(content)
    code = main(["train", "--nproc-per-node", "2", "--model", "tiny-llama", "--data", str(data)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err and str(data) in err, err


def test_flags_the_ds_config_file_replaces_are_named(tmp_path):
    """`--ds-config` wins over the flags behind its "auto" values, as documented; a flag given on the command line
    that the file replaces was dropped without a word."""
    from zeroshard.integrations.ds_config import TrainHyper, overridden_flags

    path = tmp_path / "ds.json"
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": "auto"}}, "bf16": {"enabled": True}}
    path.write_text(json.dumps({**config, "train_micro_batch_size_per_gpu": 4}))
    hyper = TrainHyper(4, 1, 5e-4, 0.0, 0, 10, 1.0, "fp32")
    given = {"--lr", "--micro-batch", "--weight-decay", "--dtype", "--seed"}
    lines = overridden_flags(str(path), hyper, 1, given)
    assert [line.split(":")[0] for line in lines] == [
        "--dtype is not used for bf16.enabled",
        "--lr is not used for optimizer.params.lr",
    ]
    assert f"{path} sets 0.0001 there" in lines[1] and 'write "auto" there' in lines[1]
    assert overridden_flags(str(path), hyper, 1, {"--max-steps"}) == []  # not set by the file: the flag's value


def test_a_text_file_is_read_up_to_the_limit_only(tmp_path):
    """--data-bytes (and the launcher's 1 GiB check) stop reading a text file there: it was read whole, then cut."""
    from zeroshard.integrations.text_data import DataError, DataSpec, check_contents, read_documents

    path = tmp_path / "data.txt"
    path.write_bytes(b"x" * 100_000 + b"\xff")  # not UTF-8 well after the limit (decoding reads ahead 8 KiB)
    assert [len(doc) for doc in read_documents(DataSpec(str(path), "text", 100))] == [100]
    check_contents(DataSpec(str(path), "text", 100))
    with pytest.raises(DataError, match="is not UTF-8"):
        check_contents(DataSpec(str(path)))


def test_train_and_autotune_open_the_model_folders_weights_before_starting(tmp_path, capsys):
    """A truncated shard was found by every rank as it loaded (exit 1, a traceback for a malformed header) and by
    every autotune trial (about 60 s, then 'no trial finished'): one line naming the file, exit 2, before any
    process."""
    import torch
    from safetensors.torch import save_file

    folder = tmp_path / "model"
    folder.mkdir()
    config = {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 2}
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 16, "num_hidden_layers": 1}))
    save_file({"a": torch.zeros(4, 4), "b": torch.zeros(4)}, str(folder / "model.safetensors"))
    os.truncate(folder / "model.safetensors", os.path.getsize(folder / "model.safetensors") - 8)
    for argv in (
        ["train", "--nproc-per-node", "2", "--model", str(folder)],
        ["autotune", "--nproc-per-node", "1", "--model", str(folder)],
    ):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "model.safetensors: tensor 'b' ends at byte" in err, err
        assert "truncated" in err and not (tmp_path / "autotuning_exps").exists()


def test_validate_config_set_follows_deepspeeds_renamed_blocks(tmp_path, capsys):
    """`bfloat16` is DeepSpeed's old name of `bf16`: `--set` under either name fills its "auto" (one was refused, the
    other dropped while the config was called valid)."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 1, "bfloat16": {"enabled": "auto"}}))
    for given in ("bf16.enabled=true", "bfloat16.enabled=true"):
        assert main(["validate-config", str(path), "--json", "--set", given]) == 0
        assert json.loads(capsys.readouterr().out)["bf16"]["enabled"] is True, given
