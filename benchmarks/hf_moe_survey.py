"""Which transformers MoE causal LMs ``ep`` takes: every config class with a ``base_model_ep_plan``.

Not a timing: a survey. Each config class of the installed transformers that carries a
``base_model_ep_plan`` is built with its defaults cut to 2 layers (layer-type lists cut with
them; the whole default depth when the cut keeps no MoE layer), as its causal LM on the meta
device (no memory), and validated with ``Mesh(ep=2)``; the parameters the ep plan marks
``grouped_gemm`` that shardkit's ``ep`` would not split are named. Printed per class: ``works`` (the experts each rank holds),
``refused`` (the first lines of sk.validate's message), or why it was not tried (no causal LM
class, transformers failing to build its own default config). The table in docs/experts.md comes from this script.

    python benchmarks/hf_moe_survey.py [--only mixtral,qwen2_moe]
"""

from __future__ import annotations

import argparse
import warnings

import torch

import shardkit as sk


def _configs(only: set[str] | None) -> list[type]:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    found = []
    for model_type, name in sorted(CONFIG_MAPPING_NAMES.items()):
        if only and model_type not in only:
            continue
        try:
            config_class = getattr(transformers, name)
        except (AttributeError, ImportError):
            continue
        if getattr(config_class, "base_model_ep_plan", None):
            found.append(config_class)
    return found


def two_layer_config(config_class: type):
    """The config's defaults with 2 layers (every per-layer list cut to 2)."""
    config = config_class()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > 2:
        for key, value in list(vars(text).items()):
            if isinstance(value, list) and len(value) == layers:
                setattr(text, key, value[:2])
        text.num_hidden_layers = 2
    for key in ("first_k_dense_replace", "num_nextn_predict_layers"):
        if isinstance(getattr(text, key, None), int):
            setattr(text, key, 0 if key == "num_nextn_predict_layers" else min(getattr(text, key), 1))
    return config


def survey(config_class: type) -> tuple[str, str]:
    from transformers import AutoModelForCausalLM

    try:
        config = two_layer_config(config_class)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        if not _marked(model):  # the 2-layer cut kept no MoE layer: the defaults, whole
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config_class())
    except ValueError as error:
        if "Unrecognized configuration class" in str(error):
            return "not tried", "no causal LM class (AutoModelForCausalLM)"
        return "not tried", f"transformers cannot build it: {type(error).__name__}: {str(error).splitlines()[0][:150]}"
    except Exception as error:  # the class's own constraints on its defaults
        return "not tried", f"transformers cannot build it: {type(error).__name__}: {str(error).splitlines()[0][:150]}"
    unsplit = _marked_but_not_split(model)
    try:
        report = sk.validate(sk.Plan(mesh=sk.Mesh(ep=2)), model)
    except sk.PlanError as error:
        return "refused", " | ".join(str(p)[:220] for p in error.problems[:2]) + unsplit
    except Exception as error:
        return "error", f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    layers = report.facts.experts
    return ("works" if not unsplit else "works in part",
            f"{len(layers)} MoE layers, {layers[0].num_experts} experts, {layers[0].num_experts // 2} per rank" + unsplit)


def _marked(model) -> list[str]:
    """The parameters transformers' ep plan marks ``grouped_gemm``."""
    import re

    from shardkit.plan.hf_plan import hf_tp_plan, plan_pattern

    marked = [plan_pattern(key) for key, style in hf_tp_plan(model, "ep").items() if style == "grouped_gemm"]
    return [n for n, _ in model.named_parameters() if any(re.fullmatch(m, n) for m in marked)]


def _marked_but_not_split(model) -> str:
    """The parameters transformers' ep plan marks ``grouped_gemm`` that shardkit's ``ep`` does not split."""
    from shardkit.planner.experts import find_experts

    split = {f"{layer.name}.{p}" for layer in find_experts(model) for p in layer.params}
    missed = sorted(n for n in _marked(model) if n not in split)
    if not missed:
        return ""
    modules = sorted({type(model.get_submodule(n.rpartition(".")[0])).__name__ for n in missed})
    return f"; the ep plan's grouped_gemm {missed[0]!r} (of {', '.join(modules)}) is not an experts module shardkit finds"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types (default: every one with an ep plan)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    only = set(args.only.split(",")) if args.only else None
    counts: dict[str, int] = {}
    for config_class in _configs(only):
        verdict, detail = survey(config_class)
        counts[verdict] = counts.get(verdict, 0) + 1
        print(f"| {config_class.model_type} | {verdict} | {detail} |", flush=True)
    print(counts)


if __name__ == "__main__":
    main()
