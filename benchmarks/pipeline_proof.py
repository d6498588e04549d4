"""What the proof of a transformers model's pipeline stages adds to ``sk.validate``.

For real-size default configs (transformers' ``AutoConfig.for_model``: Llama 7B, Gemma 3, Jamba,
GPT-OSS, ...) built on the meta device, times ``sk.validate`` of a ``pp=2`` plan, whose stage
assignment proves the stages on a miniature of the model (the proof's cache cleared first),
against the baseline measured in the same run: ``sk.validate`` of the same model with the same
mesh size and no pipeline (``dp=2``). Prints the miniature's layers, the proof's seconds (best
of ``--repeat``) and the ratio of the two validations.

    .venv/bin/python benchmarks/pipeline_proof.py --repeat 3
"""

from __future__ import annotations

import argparse
import warnings

import torch

import shardkit as sk
import shardkit.planner.pipeline_proof as proof
from shardkit.plan import Mesh, Pipeline, Plan
from shardkit.planner.miniature import build_miniature
from shardkit.runtime.devices import clock

MODEL_TYPES = ("llama", "glm4", "starcoder2", "gemma3_text", "olmo3", "smollm3", "qwen3_moe", "mixtral", "jamba",
               "lfm2", "apertus", "gpt_oss", "falcon_h1", "deepseek_v3", "qwen3_next")


def best(seconds: list[float]) -> float:
    return min(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    pipelined = Plan(mesh=Mesh(pp=2), pipeline=Pipeline(microbatches=2))
    baseline = Plan(mesh=Mesh(dp=2))
    print(f"{'model type':12s} {'layers':>6s} {'mini':>4s} {'validate dp=2':>13s} {'validate pp=2':>13s} "
          f"{'ratio':>6s}")
    for model_type in MODEL_TYPES:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type))
        plain, proven = [], []
        for _ in range(args.repeat):
            start = clock()
            sk.validate(baseline, model, 2)
            plain.append(clock() - start)
            proof._PROOFS.clear()
            start = clock()
            sk.validate(pipelined, model, 2)
            proven.append(clock() - start)
        layers = build_miniature(model).layers
        print(f"{model_type:12s} {model.config.num_hidden_layers:6d} {layers:4d} {best(plain):12.3f}s "
              f"{best(proven):12.3f}s {best(proven) / best(plain):5.1f}x")


if __name__ == "__main__":
    main()
