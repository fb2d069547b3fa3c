"""Train a draft head: python train.py +experiment=medusa_llama [overrides...]

Also under Accelerate: accelerate launch [--config_file conf/accelerate/ddp.yaml] train.py ...
The command is eval/cli/train.py's `main` (installed as `draftsmith-train`): with
`export.formats=[eagle3]` (and optionally `export.push_to_hub=USER/REPO`) the kept head is
exported at the end. A bad setting or bad data prints one line with the fix (exit status 2;
HYDRA_FULL_ERROR=1 shows the traceback).
"""

from eval.cli.train import main

if __name__ == "__main__":
    main()
