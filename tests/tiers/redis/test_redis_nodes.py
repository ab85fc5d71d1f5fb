"""`NodeReport`: per-node increments and the `resting` gauge, from clients' `node_stats` (here
stand-ins that return what a test sets, as the Rust tier's would)."""

from __future__ import annotations

from typing import Any

from kvoffload.tiers.redis import NodeReport


class Client:
    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, int]] = {}

    def set(self, node: str, **values: int) -> None:
        stats = self.nodes.setdefault(
            node, {"bytes_written": 0, "bytes_read": 0, "failures": 0, "resting": 0}
        )
        stats.update(values)

    def node_stats(self) -> dict[str, dict[str, int]]:
        return {n: dict(s) for n, s in self.nodes.items()}


def report(*clients: Any) -> NodeReport:
    return NodeReport(*clients)


def test_increments_are_summed_over_clients_and_quiet_nodes_are_left_out():
    a, b = Client(), Client()
    a.set("h:1", bytes_written=100)
    b.set("h:1", bytes_written=50, bytes_read=10)
    b.set("h:2")
    r = report(a, b)
    assert r.take() == {
        "h:1": {"bytes_written": 150, "bytes_read": 10, "failures": 0, "resting": 0}
    }
    assert r.take() == {}  # nothing moved since
    a.set("h:1", bytes_written=130)
    assert r.take() == {"h:1": {"bytes_written": 30, "bytes_read": 0, "failures": 0, "resting": 0}}


def test_a_resting_node_is_reported_in_every_report_until_it_is_not():
    c = Client()
    c.set("h:1", failures=1, resting=1)
    r = report(c)
    assert r.take() == {"h:1": {"bytes_written": 0, "bytes_read": 0, "failures": 1, "resting": 1}}
    # Still resting, nothing counted: reported again, so a merge over workers keeps it at 1.
    assert r.take()["h:1"]["resting"] == 1
    c.set("h:1", resting=0)
    assert r.take()["h:1"]["resting"] == 0  # once, to bring the gauge down
    assert r.take() == {}
