"""Kahneman-Tversky optimisation (KTO) of a GPT policy on unpaired feedback (desirable / undesirable).

    torchrun --nproc_per_node N examples/nlp/gpt/train_gpt_kto.py model.init_from=SFT_CKPT \\
        'data.train=[{path: feedback.jsonl}]' [kto.beta=0.1 kto.desirable_weight=1.0 ...]
"""
from aligner.algorithms.kto import KTOConfig, build_kto_trainer
from aligner.config import run_main
from aligner.training.run import run_training

if __name__ == "__main__":
    run_main(lambda: run_training(KTOConfig, "gpt_kto.yaml", build_kto_trainer))
