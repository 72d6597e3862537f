"""The health gate's two-node all-reduce (runtime.cluster.allreduce_check) without a cluster: its
arithmetic, its verdict against a floor, node naming, and bad input as one line with exit 2
(tests/integration/test_health_allreduce.py runs it on a real two-node cluster)."""

from __future__ import annotations

import pytest

from runtime.cluster import allreduce_check as ac

NODES = [{"NodeID": "a" * 56, "NodeManagerAddress": "10.0.1.20"},
         {"NodeID": "b" * 56, "NodeManagerAddress": "10.0.1.21"},
         {"NodeID": "c" * 56, "NodeManagerAddress": "10.0.1.21"}]


def result(busbw: float) -> ac.PairResult:
    return ac.PairResult("a" * 56, "b" * 56, "10.0.1.20", "10.0.1.21", "nccl", 16, 25 * 2**20, 1e-3,
                         busbw * 8 / 15, busbw)


def test_sizes_read_as_nccl_tests_reads_them() -> None:
    assert ac.parse_size("25M") == 26214400 == ac.parse_size("26214400")
    assert ac.parse_size("1g") == 2**30 and ac.parse_size("4K") == 4096
    for bad in ("25MB", "-4", "0", "1.5M", ""):
        with pytest.raises(ac.CheckError, match="--size: expected bytes such as 26214400, 25M or 1G") as e:
            ac.parse_size(bad)
        assert e.value.code == 2
    with pytest.raises(ac.CheckError, match="multiple of 4 bytes"):
        ac.parse_size("6")


def test_bus_bandwidth_is_algbw_times_two_n_minus_one_over_n() -> None:
    # 25 MiB in 1 ms over 16 ranks: algbw 26.2 GB/s, busbw x 2 x 15/16 = 49.15 GB/s
    assert ac.bus_bandwidth_gbps(26214400, 1e-3, 16) == pytest.approx(26.2144 * 1.875)
    assert ac.bus_bandwidth_gbps(26214400, 1e-3, 2) == pytest.approx(26.2144)  # 2 ranks: busbw = algbw


def test_a_bus_bandwidth_below_the_floor_fails_the_gate_with_one_line() -> None:
    assert ac.verdict(result(9.43), 9.42) is None
    assert ac.verdict(result(9.42), 9.42) is None  # at the floor passes
    assert ac.verdict(result(0.5), None) is None  # no floor: measure only
    line = ac.verdict(result(9.41), 9.42)
    assert line is not None and "\n" not in line
    assert line.startswith("all-reduce between 10.0.1.20 (aaaaaaaaaaaa) and 10.0.1.21 (bbbbbbbbbbbb): bus bandwidth "
                           "9.41 GB/s (26214400 bytes, 16 ranks, nccl) is below the floor 9.42 GB/s: ")


def test_nodes_are_named_by_id_prefix_or_unambiguous_address() -> None:
    assert ac.resolve_node("10.0.1.20", NODES) is NODES[0]
    assert ac.resolve_node("bbbbbbbb", NODES) is NODES[1]
    with pytest.raises(ac.CheckError, match=r"'10.0.1.21' names 2 alive nodes: name it by node id") as e:
        ac.resolve_node("10.0.1.21", NODES)
    assert e.value.code == 2
    with pytest.raises(ac.CheckError, match=r"no alive Ray node is '10.0.9.9'; alive: 10.0.1.20 \(aaaaaaaaaaaa\)"):
        ac.resolve_node("10.0.9.9", NODES)
    with pytest.raises(ac.CheckError, match="no alive Ray node is 'bbb'"):
        ac.resolve_node("bbb", NODES)  # a prefix under 8 characters is no id


PAIR = ["--node", "x", "--peer", "y"]


@pytest.mark.parametrize(("argv", "message"), [
    ([*PAIR, "--size", "lots"], "allreduce_check: --size: expected bytes such as 26214400, 25M or 1G, got 'lots'"),
    ([*PAIR, "--min-busbw-gbps", "-1"], "allreduce_check: argument --min-busbw-gbps: expected > 0, got -1"),
    ([*PAIR, "--device", "tpu"], "allreduce_check: argument --device: invalid choice: 'tpu' "
                                 "(choose from 'auto', 'cuda', 'cpu')"),
    (["--node", "x"], "allreduce_check: the following arguments are required: --peer"),
    ([*PAIR, "--address", "headnode"], "allreduce_check: --address: expected the head's host:port, got 'headnode'"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_connection(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = ac.main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    assert (code, out.out, out.err) == (2, "", message + "\n")


def test_a_head_address_nothing_listens_on_is_one_line_and_exit_3_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    """Not Ray's minute of connect retries and warnings: nothing was measured."""
    import socket

    with socket.socket() as s:  # a port just freed: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ac.main([*PAIR, "--address", f"127.0.0.1:{port}"])
    out = capsys.readouterr()
    assert code == 3 and out.out == "", out
    assert out.err.startswith(f"allreduce_check: no Ray cluster at 127.0.0.1:{port}: ") and out.err.count("\n") == 1
