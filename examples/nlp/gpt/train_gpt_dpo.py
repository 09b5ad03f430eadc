"""Direct preference optimisation (DPO, IPO, RPO, conservative DPO) of a GPT policy.

    torchrun --nproc_per_node N examples/nlp/gpt/train_gpt_dpo.py model.init_from=SFT_CKPT \\
        'data.train=[{path: preferences.jsonl}]' [dpo.beta=0.1 dpo.preference_loss=dpo ...]
"""
from aligner.algorithms.dpo import DPOConfig, build_dpo_trainer
from aligner.config import run_main
from aligner.training.run import run_training

if __name__ == "__main__":
    run_main(lambda: run_training(DPOConfig, "gpt_dpo.yaml", build_dpo_trainer))
