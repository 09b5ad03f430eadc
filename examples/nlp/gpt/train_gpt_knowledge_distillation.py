"""Knowledge distillation (SFT-KD): a student trained on a teacher's precomputed top-k logits plus the NLL.

    python examples/nlp/data/compute_teacher_topk.py teacher=TEACHER data.path=sft.jsonl output=sft.topk.safetensors
    torchrun --nproc_per_node N examples/nlp/gpt/train_gpt_knowledge_distillation.py model.init_from=STUDENT \\
        'data.train=[{path: sft.jsonl, teacher_topk: sft.topk.safetensors}]' [kd.sft_loss_weight=0.5 ...]
"""
from aligner.algorithms.distillation import KDConfig, build_kd_trainer
from aligner.config import run_main
from aligner.training.run import run_training

if __name__ == "__main__":
    run_main(lambda: run_training(KDConfig, "gpt_knowledge_distillation.yaml", build_kd_trainer))
