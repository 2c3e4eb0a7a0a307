"""The `zeroshard` command: validate-config, report, estimate, launch, train.

    $ zeroshard estimate --model llama-2-7b --gpus 8
    $ zeroshard launch --nproc_per_node 2 train.py --deepspeed ds_config.json
    $ zeroshard train --nproc-per-node 2 --model tiny-llama --zero-stage 2 --max-steps 50

`main.py` dispatches; each subcommand lives in its own module with `add_parser` and `run`.
"""
