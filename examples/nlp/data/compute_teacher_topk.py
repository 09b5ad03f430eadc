"""The teacher pass of knowledge distillation: the teacher's top-k logits at every response position of an
SFT file, written for examples/nlp/gpt/train_gpt_knowledge_distillation.py (aligner/conf/teacher_topk.yaml).

    torchrun --nproc_per_node TPxPP examples/nlp/data/compute_teacher_topk.py teacher=CKPT data.path=sft.jsonl \\
        output=sft.topk.safetensors [top_k=16 parallel.tensor_model_parallel_size=2 ...]
"""
from aligner.algorithms.distillation import TeacherTopKConfig, compute_teacher_topk
from aligner.config import CONF_DIR, load_config, parse_command_line, run_main


def main() -> None:
    config_path, overrides = parse_command_line(CONF_DIR / "teacher_topk.yaml", schema=TeacherTopKConfig)
    print(compute_teacher_topk(load_config(TeacherTopKConfig, config_path, overrides)))


if __name__ == "__main__":
    run_main(main)
