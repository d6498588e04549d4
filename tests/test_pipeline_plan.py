"""Pipeline spec and stage assignment, checked with no processes (models on the meta device)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scoped_net import Block, ScopedNet
from torch import nn

import shardkit as sk
from shardkit.families import model_layout
from shardkit.models.gpt import GPT, GPTConfig
from shardkit.models.hf import build_tiny_llama
from shardkit.plan import Mesh, Pipeline, Plan, PlanError
from shardkit.plan.pipeline import SCHEDULES, pipeline_from_args, theoretical_bubble
from shardkit.planner.explain_stages import explain_stages
from shardkit.planner.meta import meta_model
from shardkit.planner.stages import StageTie, assign_stages, stage_ranks
from shardkit.planner.validate import validate


def gpt(layers: int = 4) -> nn.Module:
    return meta_model(GPT, GPTConfig(layers=layers, dim=32, heads=2, seq_len=16))


def problems(pipeline: Pipeline, mesh: Mesh) -> str:
    return "\n".join(pipeline.check_mesh(mesh))


# -- serialisation -------------------------------------------------------------------------------
pipelines = st.builds(
    Pipeline,
    stages=st.none() | st.integers(1, 16),
    split_points=st.none() | st.lists(st.sampled_from(["layers.1", "layers.2", "norm_f"]), max_size=3),
    split=st.sampled_from(["even", "auto", "scopes"]),
    schedule=st.sampled_from(list(SCHEDULES)),
    microbatches=st.integers(1, 64),
    virtual_stages=st.integers(1, 4),
    objective=st.sampled_from(["time", "memory"]),
    memory_limit=st.none() | st.integers(1, 2**40),
)


@settings(max_examples=60, deadline=None)
@given(pipelines)
def test_plan_with_pipeline_round_trips_exactly_through_json_and_yaml(pipeline):
    plan = Plan(mesh=Mesh(pp=2, dp=2), pipeline=pipeline)
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_yaml(plan.to_yaml()) == plan
    assert Plan.from_json(plan.to_json()).pipeline.to_dict() == pipeline.to_dict()


def test_stage_module_lists_round_trip():
    pipeline = Pipeline(stage_modules=[["embed", "layers.0"], ["layers.1", "norm_f", "lm_head"]], schedule="gpipe")
    assert Pipeline.from_dict(pipeline.to_dict()) == pipeline
    assert Plan.from_yaml(Plan(mesh=Mesh(pp=2), pipeline=pipeline).to_yaml()).pipeline == pipeline


def test_unknown_keys_and_values_are_rejected_with_the_valid_ones():
    with pytest.raises(PlanError, match="unknown keys \\['stagez'\\]"):
        Pipeline.from_dict({"stagez": 2})
    with pytest.raises(PlanError, match=r"schedule='pipedream'\) is unknown; valid: .*'1f1b'"):
        Pipeline(schedule="pipedream")
    with pytest.raises(PlanError, match=r"split='random'\) is unknown"):
        Pipeline(split="random")
    with pytest.raises(PlanError, match="microbatches=0"):
        Pipeline(microbatches=0)
    with pytest.raises(PlanError, match="split_points or stage_modules, not both"):
        Pipeline(split_points=["layers.1"], stage_modules=[["embed"], ["layers.1"]])


# -- schedule constraints against the mesh ------------------------------------------------------------
def test_1f1b_needs_at_least_as_many_microbatches_as_devices():
    text = problems(Pipeline(schedule="1f1b", microbatches=2), Mesh(pp=4))
    assert "microbatches=2 for pp=4" in text and "microbatches >= 4" in text
    assert problems(Pipeline(schedule="1f1b", microbatches=4), Mesh(pp=4)) == ""


def test_schedule_and_stage_count_constraints():
    assert "needs a mesh axis 'pp'" in problems(Pipeline(), Mesh(dp=2))
    assert "stages=3 but pp=2" in problems(Pipeline(stages=3, schedule="gpipe"), Mesh(pp=2))
    assert "microbatches must be 1" in problems(Pipeline(schedule="sequential", microbatches=4), Mesh(pp=2))
    assert "virtual_stages >= 2" in problems(Pipeline(schedule="interleaved-1f1b", microbatches=4), Mesh(pp=2))
    assert "one stage per device" in problems(Pipeline(schedule="gpipe", virtual_stages=2), Mesh(pp=2))
    assert "exactly virtual_stages=2" in problems(Pipeline(schedule="zbv", microbatches=4, virtual_stages=3), Mesh(pp=2))
    assert "multiple of max(1, microbatches // pp)" in problems(
        Pipeline(schedule="interleaved-1f1b", microbatches=5, virtual_stages=2), Mesh(pp=2))
    assert "split_points ['layers.2'] make 2 stages but the pipeline has 4" in problems(
        Pipeline(split_points=["layers.2"], schedule="gpipe"), Mesh(pp=4))
    assert "FSDP2's gradient hooks (used for dp=2)" in problems(Pipeline(schedule="zbv", microbatches=2,
                                                                       virtual_stages=2), Mesh(pp=2, dp=2))
    assert "memory_limit applies to split='auto' only" in problems(
        Pipeline(schedule="gpipe", memory_limit=10), Mesh(pp=2))


def test_plan_validate_reports_schedule_problems_before_launch():
    plan = Plan(mesh=Mesh(pp=4), pipeline=Pipeline(schedule="1f1b", microbatches=2))
    with pytest.raises(PlanError, match="microbatches >= 4"):
        validate(plan, gpt())


def test_batch_must_split_into_microbatches_per_data_rank():
    pipeline = Pipeline(schedule="gpipe", microbatches=4)
    assert pipeline.check_batch(8) == [] and pipeline.check_batch(16, data_world=2) == []
    assert "does not split into 4 equal micro-batches" in pipeline.check_batch(6)[0]
    assert "over 2 data-parallel replicas" in pipeline.check_batch(7, data_world=2)[0]
    assert "4 samples per data rank does not split into 8" in Pipeline(microbatches=8).check_batch(8, 2)[0]


def test_pipeline_from_command_line_options():
    assert pipeline_from_args(Mesh(dp=2)) is None
    pipe = pipeline_from_args(Mesh(pp=4), "1f1b", 8, "auto")
    assert (pipe.schedule, pipe.microbatches, pipe.split) == ("1f1b", 8, "auto")
    assert pipeline_from_args(Mesh(pp=2), "gpipe", 4, None, "layers.2, norm_f").split_points == ("layers.2", "norm_f")
    assert pipeline_from_args(Mesh(pp=2), "interleaved-1f1b", 4).virtual_stages == 2
    assert pipeline_from_args(Mesh(pp=2), "sequential").microbatches == 1
    with pytest.raises(PlanError, match="no 'pp' axis"):
        pipeline_from_args(Mesh(dp=2), "1f1b")


def test_theoretical_bubble():
    assert theoretical_bubble("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble("interleaved-1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    assert theoretical_bubble("sequential", 4, 1) == pytest.approx(3 / 4)


# -- stage assignment ------------------------------------------------------------------------------------
def test_split_points_begin_new_stages_and_keep_every_parameter_in_one_stage():
    model = gpt(8)
    a = assign_stages(model, Pipeline(split_points=["layers.4"], schedule="gpipe"), Mesh(pp=2))
    assert a.unit_names(0) == ["embed", "layers.0", "layers.1", "layers.2", "layers.3"]
    assert a.unit_names(1) == ["layers.4", "layers.5", "layers.6", "layers.7", "norm_f", "lm_head"]
    assert a.modules(0)[:2] == ["embed", "pos_embed"]
    held = [n for s in range(2) for m in a.modules(s) for n, _ in model.get_submodule(m).named_parameters(prefix=m)]
    assert sorted(held) == sorted(n for n, _ in model.named_parameters())


def test_unknown_split_point_names_the_module_and_the_valid_ones():
    with pytest.raises(PlanError) as err:
        assign_stages(gpt(), Pipeline(split_points=["layer.2"], schedule="gpipe"), Mesh(pp=2))
    assert "'layer.2' is not a module" in str(err.value) and "'layers.2'" in str(err.value)
    plan = Plan(Mesh(pp=2), pipeline=Pipeline(split_points=["layer.2"], schedule="gpipe"))
    with pytest.raises(PlanError) as err:  # the same problem through sk.validate
        validate(plan, gpt())
    assert "'layer.2' is not a module" in err.value.problems[0]


def test_split_points_inside_a_unit_out_of_order_or_first_are_rejected():
    with pytest.raises(PlanError, match="'layers.1.attn' is inside pipeline unit 'layers.1'"):
        assign_stages(gpt(), Pipeline(split_points=["layers.1.attn"], schedule="gpipe"), Mesh(pp=2))
    with pytest.raises(PlanError, match="'pos_embed' is inside pipeline unit 'embed'"):
        assign_stages(gpt(), Pipeline(split_points=["pos_embed"], schedule="gpipe"), Mesh(pp=2))
    with pytest.raises(PlanError, match="distinct and in execution order; e.g. \\['layers.1', 'layers.3'\\]"):
        assign_stages(gpt(), Pipeline(split_points=["layers.3", "layers.1"], schedule="gpipe"), Mesh(pp=3))
    with pytest.raises(PlanError, match="stage 0 would be empty"):
        assign_stages(gpt(), Pipeline(split_points=["embed"], schedule="gpipe"), Mesh(pp=2))


def test_more_stages_than_blocks_is_an_error():
    with pytest.raises(PlanError, match="4 stages but the model has only 2 blocks"):
        assign_stages(gpt(2), Pipeline(schedule="gpipe"), Mesh(pp=4))
    with pytest.raises(PlanError, match="8 stages but the model has only 5 pipeline units"):
        assign_stages(gpt(2), Pipeline(schedule="gpipe", split="auto"), Mesh(pp=8))


def test_even_split_spreads_blocks_and_puts_embeddings_first_and_head_last():
    a = assign_stages(gpt(6), Pipeline(schedule="1f1b", microbatches=4), Mesh(pp=4))
    assert [a.unit_names(s) for s in range(4)] == [
        ["embed", "layers.0", "layers.1"], ["layers.2", "layers.3"], ["layers.4"], ["layers.5", "norm_f", "lm_head"]]


def test_explicit_module_lists_per_stage():
    lists = [["embed", "pos_embed", "layers.0"], ["layers.1", "layers.2"], ["layers.3", "norm_f", "lm_head"]]
    a = assign_stages(gpt(), Pipeline(stage_modules=lists, schedule="gpipe"), Mesh(pp=3))
    assert [a.modules(s) for s in range(3)] == lists
    a = assign_stages(gpt(), Pipeline(stage_modules=[["embed", "pos_embed", "layers"], ["norm_f", "lm_head"]],
                                      schedule="gpipe"), Mesh(pp=2))
    assert a.unit_names(0)[-1] == "layers.3"


def test_module_lists_must_place_every_module_once_contiguously():
    def bad(lists, pp=2):
        with pytest.raises(PlanError) as err:
            assign_stages(gpt(), Pipeline(stage_modules=lists, schedule="gpipe"), Mesh(pp=pp))
        return str(err.value)

    missing = bad([["embed", "pos_embed", "layers.0"], ["layers.1", "layers.2", "layers.3"]])
    assert "['norm_f'] are in no stage" in missing and "['lm_head'] are in no stage" in missing
    assert "listed in stages 0 and 1" in bad([["embed", "pos_embed", "layers"], ["layers.3", "norm_f", "lm_head"]])
    assert "unit 'embed'" in bad([["embed", "layers.0"], ["pos_embed", "layers.1", "layers.2", "layers.3", "norm_f",
                                                          "lm_head"]])
    assert "not contiguous" in bad([["embed", "pos_embed", "layers.0", "layers.2"],
                                    ["layers.1", "layers.3", "norm_f", "lm_head"]])
    assert "'layers.0.mlp', which is inside pipeline unit 'layers.0'" in bad(
        [["embed", "pos_embed", "layers.0.mlp"], ["layers", "norm_f", "lm_head"]])


def test_scopes_produce_the_intended_stages():
    a = assign_stages(meta_model(ScopedNet), Pipeline(split="scopes", schedule="gpipe"), Mesh(pp=2))
    assert a.layout.kind == "chain"
    assert [a.unit_names(0), a.unit_names(1)] == [["embed", "block1"], ["block2", "head"]]


def test_scope_tags_survive_blocks_built_inside_and_registered_outside():
    class Late(nn.Module):
        def __init__(self):
            super().__init__()
            with sk.stage(1):
                block = Block()          # registered below, outside the scope: its children carry the tag
            with sk.stage(0):
                self.first = Block()
            self.second = block

        def forward(self, x):
            return self.second(self.first(x))

    a = assign_stages(meta_model(Late), Pipeline(split="scopes", schedule="gpipe"), Mesh(pp=2))
    assert [a.unit_names(0), a.unit_names(1)] == [["first"], ["second"]]


def test_bad_scopes_are_rejected():
    class Untagged(nn.Module):
        def __init__(self):
            super().__init__()
            with sk.stage(0):
                self.a = Block()
            self.b = Block()

        def forward(self, x):
            return self.b(self.a(x))

    class Backwards(nn.Module):
        def __init__(self):
            super().__init__()
            with sk.stage(1):
                self.a = Block()
            with sk.stage(0):
                self.b = Block()

        def forward(self, x):
            return self.b(self.a(x))

    with pytest.raises(PlanError, match="'b' has parameters but was built outside any sk.stage"):
        assign_stages(meta_model(Untagged), Pipeline(split="scopes", schedule="gpipe"), Mesh(pp=2))
    with pytest.raises(PlanError, match="not contiguous in execution order: 'b' is in stage 0 but runs after 'a'"):
        assign_stages(meta_model(Backwards), Pipeline(split="scopes", schedule="gpipe"), Mesh(pp=2))
    with pytest.raises(PlanError, match="a stage index is an integer >= 0"):
        with sk.stage(-1):
            pass


def test_execution_order_not_registration_order_defines_contiguity():
    class Reordered(nn.Module):
        def __init__(self):
            super().__init__()
            self.late = nn.Linear(8, 8)
            self.early = nn.Linear(8, 8)

        def forward(self, x):
            return self.late(self.early(x))

    layout = model_layout(meta_model(Reordered))
    assert [u.name for u in layout.units] == ["early", "late"]


def test_models_that_are_not_chains_are_rejected():
    class Skip(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.b(self.a(x) + x)

    with pytest.raises(PlanError, match="not a chain of its modules: 'b' does not take the output of 'a'"):
        assign_stages(meta_model(Skip), Pipeline(schedule="gpipe"), Mesh(pp=2))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        return self.head(self.mid(self.embed(idx)))


class Gain(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.g = nn.Parameter(torch.linspace(0.5, 2.0, d))

    def forward(self, x):
        return torch.relu(x) * self.g


class GainFirst(nn.Module):
    """Registered gain, fc1, fc2; runs fc1, gain, fc2 (the order a chain's stages must follow)."""

    def __init__(self):
        super().__init__()
        self.gain, self.fc1, self.fc2 = Gain(), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(self.gain(self.fc1(x)))


class Gains(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Gain(), Gain()

    def forward(self, x):
        return self.a(self.b(x))


def test_a_chain_is_staged_in_the_order_it_runs_or_refused_when_that_cannot_be_found():
    """The first registered child gave no input to guess from, so registration order was taken unchecked."""
    a = assign_stages(meta_model(GainFirst), Pipeline(schedule="gpipe"), Mesh(pp=2))
    assert [u.name for u in a.layout.units] == ["fc1", "gain", "fc2"]
    with pytest.raises(PlanError, match=r"cannot tell in which order Gains's children run without an example input"):
        assign_stages(meta_model(Gains), Pipeline(schedule="gpipe"), Mesh(pp=2))
    a = assign_stages(meta_model(Gains), Pipeline(schedule="gpipe"), Mesh(pp=2), example_inputs=(torch.zeros(1, 8),))
    assert [u.name for u in a.layout.units] == ["b", "a"]
    a = assign_stages(nn.Sequential(Gain(), Gain()), Pipeline(schedule="gpipe"), Mesh(pp=2))
    assert [u.name for u in a.layout.units] == ["0", "1"]


def test_tied_weights_across_stages_are_recorded_and_within_one_stage_are_not():
    a = assign_stages(meta_model(Tied), Pipeline(split_points=["mid"], schedule="gpipe"), Mesh(pp=2))
    assert a.ties == (StageTie(("embed.weight", "head.weight"), (0, 1)),)  # the runtime keeps the copies equal
    a = assign_stages(meta_model(Tied), Pipeline(split_points=["mid", "head"], schedule="gpipe"), Mesh(pp=3))
    assert a.ties == (StageTie(("embed.weight", "head.weight"), (0, 2)),)
    two = nn.Sequential(Tied(), nn.Linear(32, 4))
    a = assign_stages(two, Pipeline(split_points=["1"], schedule="gpipe"), Mesh(pp=2))
    assert a.unit_names(0) == ["0"] and a.ties == ()


def test_hf_llama_units_and_rotary_embedding_on_every_stage():
    model = meta_model(build_tiny_llama)
    a = assign_stages(model, Pipeline(schedule="gpipe"), Mesh(pp=2))
    assert a.layout.kind == "hf-causal-lm" and a.layout.shared == ("model.rotary_emb",)
    assert a.unit_names(0) == ["model.embed_tokens", "model.layers.0"]
    assert a.unit_names(1) == ["model.layers.1", "model.norm", "lm_head"]


def test_stage_to_device_mapping():
    assert stage_ranks(4, 4, "1f1b") == (0, 1, 2, 3)
    assert stage_ranks(8, 4, "interleaved-1f1b") == (0, 1, 2, 3, 0, 1, 2, 3)
    assert stage_ranks(8, 4, "zbv") == (0, 1, 2, 3, 3, 2, 1, 0)


def test_explain_stages_lists_modules_bytes_costs_and_balance():
    plan = Plan(mesh=Mesh(pp=2), pipeline=Pipeline(split_points=["layers.3"], schedule="gpipe", microbatches=2))
    text = explain_stages(plan, gpt())
    lines = text.splitlines()
    assert "2 stages on pp=2, schedule gpipe" in lines[0]
    assert "embed, layers.0-2" in lines[2] and "layers.3, norm_f, lm_head" in lines[3]
    model = gpt()
    stage0 = sum(p.numel() for m in ("embed", "pos_embed", "layers.0", "layers.1", "layers.2")
                 for p in model.get_submodule(m).parameters())
    assert f" {stage0} " in lines[2]
    assert "balance (slowest / mean stage time)" in lines[-1]
