"""The server knows nothing about roles: a role's node is built outside it (pdkv.disagg.node)
and handed in; a role config without one is refused instead of silently served colocated."""
from __future__ import annotations

import pytest

from pdkv.config import config_from_dict
from pdkv.server.app import build_app


@pytest.mark.parametrize("role,extra", [("decode", {"messenger": {"prefill_peers": ["127.0.0.1:7100"]}}),
                                        ("prefill", {})])
def test_a_role_config_without_its_node_is_refused(role, extra):
    cfg = config_from_dict({"role": role, **extra}, source="x.yaml")
    with pytest.raises(ValueError, match=rf"x.yaml: role '{role}' needs its node \(pdkv.disagg.node.build_node"):
        build_app(cfg, engine=None)
