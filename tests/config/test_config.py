"""YAML role configs: loading, --set overrides, and errors that name the file, field and expectation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdkv.config import Config, ConfigError, config_to_dict, load_config

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "role.yaml"
    p.write_text(text)
    return p


def test_colocated_yaml_loads_into_frozen_dataclasses():
    cfg = load_config(ROOT / "configs" / "colocated.yaml")
    assert cfg.role == "colocated"
    assert cfg.model.path == ""  # the embedded default model
    assert cfg.kv_cache.layout == "HND" and cfg.kv_cache.page_size == 16
    assert cfg.source.endswith("colocated.yaml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.server.port = 1  # type: ignore[misc]


def test_every_shipped_config_is_valid():
    files = sorted((ROOT / "configs").glob("*.yaml"))
    assert files
    for f in files:
        import yaml

        if {"prefill", "decode"} & set(yaml.safe_load(f.read_text())):  # a `pdkv up` cluster file
            import tempfile

            from pdkv.disagg.launcher import role_configs

            with tempfile.TemporaryDirectory() as tmp:
                roles = role_configs(str(f), [], Path(tmp))
            assert [r[2].role for r in roles.values()][0] == "prefill", f
            assert {r[2].role for r in roles.values()} == {"prefill", "decode"}, f
            continue
        if "slo" in yaml.safe_load(f.read_text()):  # a `pdkv planner` file
            from pdkv.planner.config import load_planner_config

            assert load_planner_config(f).policy, f
            continue
        if "nodes" in yaml.safe_load(f.read_text()):  # a `pdkv router` file
            from pdkv.config.router import load_router_config

            assert load_router_config(f).nodes, f
            continue
        cfg = load_config(f, check_paths=False)
        assert cfg.role in ("colocated", "prefill", "decode"), f


def test_yaml_values_and_types(tmp_path):
    cfg = load_config(write(tmp_path, """
role: decode
model: {path: "", dtype: bfloat16, max_model_len: 4096}
kv_cache: {page_size: 32, num_pages: 100, memory_fraction: 1, layout: NHD}
scheduler: {max_num_batched_tokens: 1024, chunk_size: 256}
server: {port: 0, api_key: secret}
messenger: {transport: verbs, nics: mlx5_0, prefill_peers: ["10.0.0.2:7100"]}
"""))
    assert cfg.role == "decode" and cfg.model.dtype == "bfloat16" and cfg.model.max_model_len == 4096
    assert cfg.kv_cache.memory_fraction == 1.0 and isinstance(cfg.kv_cache.memory_fraction, float)
    assert cfg.kv_cache.num_pages == 100 and cfg.kv_cache.layout == "NHD"
    assert cfg.server.api_key == "secret" and cfg.server.port == 0
    assert cfg.messenger.nics == ("mlx5_0",)  # a single string becomes a one-element tuple
    # Untouched fields keep their defaults.
    assert cfg.scheduler.max_num_seqs == Config().scheduler.max_num_seqs


def test_empty_file_is_the_defaults(tmp_path):
    cfg = load_config(write(tmp_path, "# nothing\n"))
    assert config_to_dict(cfg) == config_to_dict(Config())


def test_set_overrides_mirror_the_yaml(tmp_path):
    model = tmp_path / "qwen"
    model.mkdir()
    cfg = load_config(ROOT / "configs" / "colocated.yaml",
                      ["server.port=8001", f"model.path={model}", "server.api_key=12345",
                       "model.max_model_len=null", "messenger.nics=[mlx5_0, mlx5_1]", "kv_cache.memory_gib=2"])
    assert cfg.server.port == 8001
    assert cfg.model.path == str(model)
    assert cfg.server.api_key == "12345"  # a string field keeps the text, even when it looks like a number
    assert cfg.model.max_model_len is None
    assert cfg.messenger.nics == ("mlx5_0", "mlx5_1")
    assert cfg.kv_cache.memory_gib == 2.0


@pytest.mark.parametrize("text, needle", [
    ("kv_cache:\n  layout: HDN\n", "role.yaml: kv_cache.layout must be one of HND, NHD, got 'HDN'"),
    ("server:\n  port: eighty\n", "role.yaml: server.port must be an integer, got 'eighty'"),
    ("server:\n  port: 70000\n", "role.yaml: server.port must be a TCP port in 0..65535"),
    ("role: both\n", "role.yaml: role must be one of colocated, prefill, decode, got 'both'"),
    ("model:\n  pth: /x\n", "role.yaml: unknown field model.pth (known in model: path, dtype"),
    ("modle:\n  path: /x\n", "role.yaml: unknown field modle"),
    ("model: 3\n", "role.yaml: model must be a mapping, got 3 (int)"),
    ("kv_cache:\n  page_size: 12\n", "role.yaml: kv_cache.page_size must be a power of two, got 12"),
    ("kv_cache:\n  num_pages: true\n", "role.yaml: kv_cache.num_pages must be an integer or null, got True"),
    ("kv_cache:\n  memory_fraction: 1.5\n", "role.yaml: kv_cache.memory_fraction must be in (0, 1]"),
    ("scheduler:\n  chunk_size: 4096\n", "scheduler.chunk_size must be positive and at most "
                                         "scheduler.max_num_batched_tokens (2048)"),
    ("model:\n  dtype: float8\n", "role.yaml: model.dtype must be one of float32, bfloat16, float16, auto"),
    ("model:\n  device: gpu\n", "role.yaml: model.device must be cpu, cuda or cuda:N, got 'gpu'"),
    ("model:\n  path: /does/not/exist\n", "role.yaml: model.path must be a local Hugging Face model folder"),
    ("messenger:\n  transport: udp\n", "role.yaml: messenger.transport must be one of tcp, verbs, libfabric, shm, auto, got 'udp'"),
    ("messenger:\n  fault_shm_fail_maps: -1\n", "role.yaml: messenger.fault_shm_fail_maps must be a count of grants"),
    ("messenger:\n  libfabric: {provider: psm3}\n",
     "role.yaml: messenger.libfabric.provider must be one of auto, efa, tcp;ofi_rxm, sockets, shm, got 'psm3'"),
    ("messenger:\n  libfabric: {provider: shm, domains: [auto]}\n",
     "messenger.libfabric.domains must be [auto] only with provider efa"),
    ("messenger:\n  libfabric: {provider: efa, domains: [rdmap16s27-rdm, rdmap16s27-rdm]}\n",
     "messenger.libfabric.domains must be up to 16 distinct fabric domain names"),
    ("messenger:\n  libfabric: {provider: efa, domains: [auto, rdmap16s27-rdm]}\n",
     "messenger.libfabric.domains must be up to 16 distinct fabric domain names"),
    ("messenger:\n  nics: [1, 2]\n", "role.yaml: messenger.nics must be a list of strings, got [1, 2]"),
    ("- just\n- a list\n", "role.yaml: the top level must be a mapping of sections, got list"),
    ("server: {port: 80\n", "role.yaml: not valid YAML at line"),
])
def test_yaml_errors_name_file_field_and_expectation(tmp_path, text, needle):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert needle in str(e.value)


def test_missing_file_is_named():
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read config file"):
        load_config("nope.yaml")


@pytest.mark.parametrize("item, needle", [
    ("server.port=abc", "--set server.port=abc: server.port must be an integer, got 'abc'"),
    ("server.prot=1", "--set server.prot=1: unknown field 'server.prot' (known: host, port, api_key"),
    ("kv_cache.layout=HDN", "--set kv_cache.layout=HDN: kv_cache.layout must be one of HND, NHD"),
    ("server=1", "--set server=1: server is a section; set one of its fields (server.host"),
    ("server.port.x=1", "--set server.port.x=1: server.port is a value, not a section"),
    ("novalue", "--set novalue: expected KEY=VALUE"),
    ("=3", "--set =3: expected KEY=VALUE"),
])
def test_set_errors_name_the_override(item, needle):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "colocated.yaml", [item])
    assert needle in str(e.value)


def test_check_paths_off_allows_configs_for_other_hosts(tmp_path):
    cfg = load_config(write(tmp_path, "model:\n  path: /models/elsewhere\n"), check_paths=False)
    assert cfg.model.path == "/models/elsewhere"


def test_libfabric_takes_several_domains(tmp_path):
    """One transport over several domains (an EFA device each), or a domain under one fabric."""
    from pdkv.config import config_from_dict

    doms = ["rdmap16s27-rdm", "rdmap32s27-rdm", "lo@::1/128"]
    cfg = config_from_dict({"messenger": {"transport": "libfabric", "libfabric": {"provider": "efa",
                                                                                  "domains": doms}}})
    assert cfg.messenger.libfabric.domains == tuple(doms)
