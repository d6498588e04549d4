"""Every transformers causal LM on meta: built as a user builds it, validated under a few plans.

Not a timing: a survey of architectures nobody in shardkit wrote. Each config class of the installed
transformers that has a causal LM class is built with its defaults cut to 2 layers (as
``hf_moe_survey.py`` cuts them) by ``sk.meta_model`` and validated with each plan of ``--plans``
(``tp`` on ``LayoutMap.from_hf``'s rules). Printed per class and plan: ``ok``, ``refused`` (the first
line of ``sk.validate``'s message) or ``CRASH`` (any other exception: a bug, with the last shardkit
frame); classes transformers cannot build from their own defaults are counted apart. The crashes are
listed again at the end.

    python benchmarks/hf_survey.py [--only llama,got_ocr2] [--plans fsdp=2,sp=2,tp=2]
"""

from __future__ import annotations

import argparse
import traceback
import warnings

from hf_moe_survey import two_layer_config

import shardkit as sk


def _types(only: set[str] | None) -> list[tuple[str, type]]:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if model_type in CONFIG_MAPPING_NAMES and (not only or model_type in only):
            config_class = getattr(transformers, CONFIG_MAPPING_NAMES[model_type], None)
            if config_class is not None:
                found.append((model_type, config_class))
    return found


def _verdict(plan_text: str, model) -> str:
    mesh = sk.Mesh.parse(plan_text)
    try:
        sk.validate(sk.Plan(mesh, sk.LayoutMap.from_hf(model) if mesh.size_of("tp") > 1 else None), model)
        return "ok"
    except sk.PlanError as error:
        return f"refused ({str(error).splitlines()[0][:120]})"
    except Exception as error:
        frames = [f for f in traceback.extract_tb(error.__traceback__) if "shardkit" in f.filename]
        where = f"{frames[-1].filename.rpartition('/')[2]}:{frames[-1].lineno}" if frames else "outside shardkit"
        return f"CRASH {type(error).__name__}: {str(error).splitlines()[0][:120]} at {where}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types (default: every causal LM)")
    parser.add_argument("--plans", default="fsdp=2,sp=2,tp=2", help="comma-separated meshes, one axis each")
    args = parser.parse_args()
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    crashes, unbuilt, built = [], 0, 0
    for model_type, config_class in _types(set(args.only.split(",")) if args.only else None):
        try:
            model = sk.meta_model(AutoModelForCausalLM.from_config, two_layer_config(config_class))
        except Exception as error:  # transformers' own constructor on its defaults, or meta_model itself
            unbuilt += 1
            print(f"| {model_type} | not built: {type(error).__name__}: {str(error).splitlines()[0][:120]} |", flush=True)
            continue
        built += 1
        verdicts = [f"{plan}: {_verdict(plan, model)}" for plan in args.plans.split(",")]
        crashes += [f"{model_type} {v}" for v in verdicts if ": CRASH" in v]
        print(f"| {model_type} | " + " | ".join(verdicts) + " |", flush=True)
    print(f"{built} built and validated, {unbuilt} not built, {len(crashes)} crashes")
    for crash in crashes:
        print(crash)


if __name__ == "__main__":
    main()
