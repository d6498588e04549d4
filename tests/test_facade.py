"""The public facade: every exported name resolves, the top level stays short, the grouped
namespaces import by name, and importing it alone stays light."""

import subprocess
import sys

import pytest

import shardkit as sk

NAMESPACES = ("replicas", "collectives", "context_parallel")
#: Names that were top-level until they were grouped (issue 15), and their namespace.
GROUPED = {"variable": "replicas", "Variable": "replicas", "group_module": "replicas", "grouping_table": "replicas",
           "average_gradients": "collectives", "all_reduce": "collectives", "all_gather": "collectives",
           "reduce_scatter": "collectives", "broadcast": "collectives", "ring_attention": "context_parallel",
           "enable_context_parallel": "context_parallel", "shard_sequence": "context_parallel",
           "unshard_sequence": "context_parallel", "sequence_positions": "context_parallel",
           "check_sequence_length": "context_parallel"}


def test_every_public_name_resolves_to_its_definition():
    for name in sk.__all__:
        value = getattr(sk, name)
        assert getattr(value, "__name__", name) == name or not callable(value), name
    for group in NAMESPACES:
        namespace = getattr(sk, group)
        assert namespace.__all__, group
        for name in namespace.__all__:
            value = getattr(namespace, name)
            assert getattr(value, "__name__", name) == name or not callable(value), f"{group}.{name}"


def test_the_top_level_is_short_and_the_grouped_names_live_in_their_namespaces():
    assert len(sk.__all__) <= 62, len(sk.__all__)  # 71 names flat before; sk.train and sk.TrainConfig since; sk.dry_run
    assert set(NAMESPACES) <= set(sk.__all__) and dir(sk) == sk.__all__
    for name, group in GROUPED.items():
        assert name not in sk.__all__, name
        assert name in getattr(sk, group).__all__, (group, name)


def test_a_grouped_name_asked_for_at_the_top_level_is_found_with_a_warning_naming_its_place():
    for name, group in GROUPED.items():
        with pytest.warns(DeprecationWarning, match=rf"sk\.{name} is now sk\.{group}\.{name}"):
            assert getattr(sk, name) is getattr(getattr(sk, group), name)


def test_namespaces_import_by_name():
    from shardkit.collectives import all_reduce
    from shardkit.context_parallel import ring_attention
    from shardkit.replicas import variable

    assert (all_reduce.__module__, ring_attention.__module__, variable.__module__) == (
        "shardkit.runtime.collectives", "shardkit.runtime.ring_attention", "shardkit.runtime.variables")


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_thing"):
        sk.no_such_thing  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'Mesh'; it has: all_gather"):
        sk.collectives.Mesh  # noqa: B018


def test_spec_layer_imports_without_torch():
    code = ("import sys, shardkit as sk; sk.Plan(mesh=sk.Mesh(dp=2)).to_json(); sk.collectives; sk.replicas; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
