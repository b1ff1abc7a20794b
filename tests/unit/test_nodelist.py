"""expand_nodelist: Slurm's compressed host lists, as `scontrol show hostnames` prints them."""

from __future__ import annotations

import pytest

from collective.clusterenv import expand_nodelist
from collective.errors import UsageError


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ["node1"]),
        ("a,b,c", ["a", "b", "c"]),
        ("node[10,20-25]", ["node10", "node20", "node21", "node22", "node23", "node24", "node25"]),
        ("a[01-03],b7", ["a01", "a02", "a03", "b7"]),
        ("n[1-2]-ib,gpu[001-004]", ["n1-ib", "n2-ib", "gpu001", "gpu002", "gpu003", "gpu004"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("node[5]", ["node5"]),
        ("node[08-10]", ["node08", "node09", "node10"]),  # padding of the low end kept
        ("node[8-10]", ["node8", "node9", "node10"]),     # no padding
        ("node[098-101]", ["node098", "node099", "node100", "node101"]),
        ("x[1,3,5-6],y,z[00-01]", ["x1", "x3", "x5", "x6", "y", "z00", "z01"]),
        ("c[1-2]s[0-1]n[7]", ["c1s0n7", "c1s1n7", "c2s0n7", "c2s1n7"]),
        ("h-1.cluster.local,h[2-3].cluster.local", ["h-1.cluster.local", "h2.cluster.local", "h3.cluster.local"]),
        ("[1-2]", ["1", "2"]),
        ("dup,dup", ["dup", "dup"]),  # Slurm's order and repetitions kept
        ("  node[1-2]\n", ["node1", "node2"]),  # surrounding white space of a variable's value
    ],
)
def test_expands_the_formats_slurm_writes(text, hosts):
    assert expand_nodelist(text) == hosts


def test_a_large_range_is_expanded_in_order():
    hosts = expand_nodelist("gpu[0000-1023]")
    assert len(hosts) == 1024 and hosts[0] == "gpu0000" and hosts[-1] == "gpu1023"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "it is empty"),
        ("   ", "it is empty"),
        ("node[1-3", "never closed"),
        ("node1-3]", "']' without '['"),
        ("node[[1-2]]", "'[' inside brackets"),
        ("a,,b", "an empty name"),
        ("a,", "an empty name"),
        (",a", "an empty name"),
        ("node[]", "empty brackets"),
        ("node[3-1]", "runs backwards"),
        ("node[a-c]", "'a-c'"),
        ("node[1-]", "'1-'"),
        ("node[-2]", "'-2'"),
        ("node[1,,2]", "'' in"),
        ("node[1-2-3]", "'1-2-3'"),
        ("node [1-2]", "white space"),
        ("n[0-99999999]", "more than 100000 hosts"),
        ("a[0-999]b[0-999]", "more than 100000 hosts"),
    ],
)
def test_malformed_lists_are_one_line_usage_errors_naming_the_text(text, problem):
    with pytest.raises(UsageError) as exc:
        expand_nodelist(text, what="SLURM_STEP_NODELIST")
    message = str(exc.value)
    assert message.startswith(f"SLURM_STEP_NODELIST {text!r} is not a Slurm host list: ")
    assert problem in message
    assert "\n" not in message and exc.value.exit_code == 2
