"""topology.py, ipc.py and commfuse-probe: decisions on simulated hardware (CPU), the real probe on GPUs.

CPU: decide_mode, fusion_capability and nvlink_matrix on simulated facts, NVML counting with a fake
NVML, failures reported not raised, the probe command. GPU (2+ GPUs): driver P2P and NVLink between
GPU 0 and 1; under `mpirun -n 2 ... --with-mpi`, the IPC-confirmed "p2p" mode and the pretend override.
"""
import dataclasses
import gc
import json
import os
import re
import socket
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist

from commfuse import ipc, topology
from commfuse.cli import probe as probe_cli
from commfuse.topology import NvLinkInfo, RankInfo, decide_mode, fusion_capability, nvlink_matrix

from processes import single_process_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs 2 CUDA GPUs (this machine has "
                                     f"{torch.cuda.device_count() if torch.cuda.is_available() else 0})")
PROBE_FIELDS = {"launcher", "world_size", "host", "cuda", "versions", "gpus", "ranks", "matrix_of",
                "p2p_driver", "p2p_ipc", "p2p", "nvlink", "mode", "reasons", "local_group", "strategy",
                "overrides", "notes"}
UNIT_FIELDS = {"index", "name", "sm", "uuid", "pci_bus_id", "memory_bytes", "nvlink", "fused"}


def gpu(host="a", sm=(9, 0), device=0, bus=None, nvlink=None, boot="boot-1"):
    return RankInfo(host, device, f"GPU-{host}{boot}{device}", sm, "sim", bus or f"0000:{device + 0x19:02x}:00.0",
                    nvlink=nvlink, boot_id=boot)


def full(n):
    return [[True] * n for _ in range(n)]


# ---- decide_mode on simulated topologies --------------------------------------------------------

def test_one_node_all_pairs_p2p_takes_p2p_row():
    for n in (2, 4, 8):
        mode, reasons = decide_mode([gpu(device=i) for i in range(n)], full(n))
        assert mode == "p2p" and f"{n} ranks on one node" in reasons[0]


@pytest.mark.parametrize("missing, named, not_named", [((0, 1), "0->1", "1->0"), ((1, 0), "1->0", "0->1")])
def test_one_missing_p2p_direction_falls_back_and_names_it(missing, named, not_named):
    p2p = full(2)
    p2p[missing[0]][missing[1]] = False
    mode, reasons = decide_mode([gpu(device=0), gpu(device=1)], p2p)
    assert mode == "fallback" and named in reasons[0] and not_named not in reasons[0]


def test_mixed_sms_fall_back():
    mode, reasons = decide_mode([gpu(sm=(9, 0), device=0), gpu(sm=(8, 0), device=1)], full(2))
    assert mode == "fallback" and "8.0, 9.0" in reasons[0]


def test_old_sm_everywhere_falls_back():
    mode, reasons = decide_mode([gpu(sm=(7, 5), device=0), gpu(sm=(7, 5), device=1)], full(2))
    assert mode == "fallback" and "7.5 < 8.0" in reasons[0]


def test_an_sm_newer_than_nvrtc_falls_back(monkeypatch):
    """No kernel compiles for a GPU newer than the loaded NVRTC, the P2P all-reduce's neither: the fallback mode,
    saying so, rather than a compile error at the Communicator's first call."""
    from commfuse.kernels import jit

    monkeypatch.setattr(jit, "supported_archs", lambda: (80, 90, 100))
    monkeypatch.setattr(jit, "nvrtc_version", lambda: (12, 8))
    jit.cannot_target.cache_clear()
    try:
        mode, reasons = decide_mode([gpu(sm=(12, 0), device=0), gpu(sm=(12, 0), device=1)], full(2))
        assert mode == "fallback" and reasons[0] == ("NVRTC 12.8 cannot compile for sm_120 (it targets sm_80 to "
                                                     "sm_100): no P2P kernels, NCCL"), reasons
        assert decide_mode([gpu(sm=(10, 0), device=0), gpu(sm=(10, 0), device=1)], full(2))[0] == "p2p"
    finally:
        jit.cannot_target.cache_clear()


def test_two_nodes_fall_back_even_with_p2p_everywhere():
    ranks = [gpu("a", device=0), gpu("a", device=1), gpu("b", device=0), gpu("b", device=1)]
    mode, reasons = decide_mode(ranks, full(4))
    assert mode == "fallback" and "2 nodes" in reasons[0]


def test_machines_of_one_hostname_are_two_nodes():
    """Containers started with one --hostname (or images that all say "localhost"), on two machines: their kernels'
    boot ids tell them apart, so no P2P row, no NVLink and no driver answer across them; the same GPU index (and
    bus id) on both is two GPUs."""
    from commfuse import topology

    links = topology.NvLinkInfo(gpu_links=(), switch_links=18)
    ranks = [gpu("worker", device=0, boot="x", nvlink=links), gpu("worker", device=0, boot="y", nvlink=links)]
    mode, reasons = decide_mode(ranks, full(2))
    assert mode == "fallback" and "2 nodes" in reasons[0], reasons
    assert topology.gpu_sharers(ranks) == (1, 1)
    assert topology.nvlink_matrix(ranks) == ((None, None), (None, None))
    assert topology.driver_p2p_matrix(ranks)[0] == ((True, None), (None, True))


def test_one_rank_falls_back():
    assert decide_mode([gpu()], full(1)) == ("fallback", ("one rank: nothing to exchange, no P2P",))


def test_a_rank_without_gpu_is_cpu():
    ranks = [gpu(device=0), RankInfo("a", None, None, None, None)]
    assert decide_mode(ranks, full(2))[0] == "cpu"


def test_cpu_backend_with_gpus_is_cpu():
    mode, reasons = decide_mode([gpu(device=0), gpu(device=1)], full(2), backend="gloo")
    assert mode == "cpu" and "gloo" in reasons[0]
    assert decide_mode([gpu(device=0), gpu(device=1)], full(2), backend="nccl")[0] == "p2p"


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ranks_sharing_one_gpu_take_p2p_over_gloo_and_say_so(world):
    """A one-GPU machine with `world` ranks (gloo: NCCL refuses two ranks on one GPU)."""
    ranks = [gpu(device=0) for _ in range(world)]
    assert topology.gpu_sharers(ranks) == (world,) * world
    mode, reasons = decide_mode(ranks, full(world), backend="gloo")
    assert mode == "p2p", reasons
    assert f"{world} ranks on one node" in reasons[0]
    assert f"ranks {','.join(map(str, range(world)))} share GPU 0" in reasons[-1]
    assert "time-slices" in reasons[-1] and "MPS" in reasons[-1] and "not a speed mode" in reasons[-1]
    assert "P2P over same-device IPC" in reasons[-1]
    mode, reasons = decide_mode(ranks, full(world), pretend_no_p2p=True, backend="gloo")
    assert mode == "fallback" and "PRETEND" in reasons[0] and "share GPU 0" in reasons[-1]
    assert "P2P" not in reasons[-1]  # every reason true: no P2P in this mode
    mode, reasons = decide_mode([gpu(device=0, sm=(7, 5)) for _ in range(world)], full(world), backend="gloo")
    assert mode == "fallback" and reasons[0].endswith("no P2P kernels, gloo"), reasons  # the group's collective
    broken = full(world)
    broken[world - 1][0] = False  # the same-device IPC check failed one way
    mode, reasons = decide_mode(ranks, broken, backend="gloo")
    assert mode == "fallback" and f"{world - 1}->0" in reasons[0]


def test_ranks_sharing_some_gpus():
    """4 ranks on 2 GPUs: two per GPU; each GPU named with its ranks."""
    ranks = [gpu(device=0), gpu(device=1), gpu(device=0), gpu(device=1)]
    assert topology.gpu_sharers(ranks) == (2, 2, 2, 2)
    mode, reasons = decide_mode(ranks, full(4), backend="gloo")
    assert mode == "p2p" and "ranks 0,2 share GPU 0" in reasons[-1] and "ranks 1,3 share GPU 1" in reasons[-1]
    # One GPU per rank over gloo stays a CPU group, as before; without uuids nothing is taken as shared.
    assert topology.gpu_sharers([gpu(device=0), gpu(device=1)]) == (1, 1)
    nameless = [RankInfo("a", 0, None, (9, 0), "sim"), RankInfo("a", 0, None, (9, 0), "sim")]
    assert topology.gpu_sharers(nameless) == (1, 1)
    assert decide_mode(nameless, full(2), backend="gloo")[0] == "cpu"


def test_pretend_no_p2p_turns_p2p_into_fallback():
    ranks = [gpu(device=0), gpu(device=1)]
    assert decide_mode(ranks, full(2))[0] == "p2p"
    mode, reasons = decide_mode(ranks, full(2), pretend_no_p2p=True)
    assert mode == "fallback" and "COMMFUSE_PRETEND_NO_P2P" in reasons[0]


def test_topology_properties():
    ranks = (gpu("a", device=0), gpu("b", device=0), gpu("a", device=1), gpu("c", device=0))
    topo = topology.Topology(2, 4, ranks, tuple(map(tuple, full(4))), "fallback")
    assert topo.local_ranks == (0, 2)
    assert topo.nodes == (0, 1, 0, 2)
    assert topo.sm == (9, 0)


# ---- capability per SM ----------------------------------------------------------------------------

@pytest.mark.parametrize("sm, fp8, nvfp4", [
    ((8, 0), "fused-sw", "fused-sw"),
    ((8, 6), "fused-sw", "fused-sw"),
    ((8, 9), "fused-hw", "fused-sw"),
    ((9, 0), "fused-hw", "fused-sw"),
    ((10, 0), "fused-hw", "fused-hw"),
    ((12, 0), "fused-hw", "fused-hw"),
])
def test_fusion_capability(sm, fp8, nvfp4):
    # every format's pattern: e4m3 conversions in hardware from SM 8.9, e2m1 from 10.0
    assert fusion_capability(sm) == {"residual_rmsnorm": "fused-hw", "residual_rmsnorm_fp8": fp8,
                                     "residual_rmsnorm_nvfp4": nvfp4, "residual_rmsnorm_fp8_per_token": fp8,
                                     "residual_rmsnorm_fp8_block": fp8, "residual_rmsnorm_mxfp8": fp8}


@pytest.mark.parametrize("sm", [(7, 5), (7, 0), None])
def test_no_fusion_below_sm80_or_without_gpu(sm):
    assert set(fusion_capability(sm).values()) == {"separated"}
    assert set(fusion_capability(sm)) == set(topology.PATTERNS)


# ---- NVLink ---------------------------------------------------------------------------------------

def test_nvlink_matrix_counts_direct_and_switch_links():
    a, b, c = "0000:19:00.0", "0000:3b:00.0", "0000:4c:00.0"
    bridged = [gpu(bus=a, device=0, nvlink=NvLinkInfo(((b, 4),), 0)),
               gpu(bus=b, device=1, nvlink=NvLinkInfo(((a, 4),), 0)),
               gpu(bus=c, device=2, nvlink=NvLinkInfo((), 0))]
    assert nvlink_matrix(bridged) == ((None, 4, 0), (4, None, 0), (0, 0, None))
    switched = [gpu(bus=a, device=0, nvlink=NvLinkInfo((), 18)), gpu(bus=b, device=1, nvlink=NvLinkInfo((), 18)),
                gpu(bus=c, device=2, nvlink=None), gpu("other", bus=c, device=0, nvlink=NvLinkInfo((), 18))]
    m = nvlink_matrix(switched)
    assert m[0][1] == m[1][0] == 18
    assert m[0][2] is None and m[2][0] is None  # NVML failed on rank 2
    assert m[0][3] is None  # another host


class FakeNVML(types.SimpleNamespace):
    """The pynvml calls _nvlink makes, over a table link -> (remote type, remote bus id) or an error."""

    class NVMLError(Exception):
        def __init__(self, value):
            super().__init__(f"NVML error {value}")
            self.value = value

    NVML_NVLINK_MAX_LINKS, NVML_FEATURE_ENABLED = 8, 1
    NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_GPU_IS_LOST = 2, 3, 15
    NVML_NVLINK_DEVICE_TYPE_GPU, NVML_NVLINK_DEVICE_TYPE_SWITCH = 0, 2

    def __init__(self, links, error=None):
        super().__init__(links=links, error=error)

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        return bus

    def nvmlDeviceGetNvLinkState(self, handle, link):
        if link == 5 and self.error:
            raise self.NVMLError(self.error)
        if link >= 6:
            raise self.NVMLError(self.NVML_ERROR_INVALID_ARGUMENT)
        return int(link in self.links)

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle, link):
        return self.links[link][0]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle, link):
        return types.SimpleNamespace(busId=self.links[link][1])


def test_nvlink_counts_links_per_peer_and_switch(monkeypatch):
    nv = FakeNVML({0: (0, b"00000000:3B:00.0"), 1: (0, b"00000000:3B:00.0"), 2: (2, None),
                   3: (0, "00000000:4C:00.0"), 4: (2, None)})
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    # NVML writes 8-digit domains in upper case; the counts are keyed like CUDA's bus ids.
    assert topology._nvlink("0000:19:00.0") == NvLinkInfo((("0000:3b:00.0", 2), ("0000:4c:00.0", 1)), 2)


def test_nvlink_error_other_than_missing_link_raises(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML({0: (2, None)}, error=FakeNVML.NVML_ERROR_GPU_IS_LOST))
    with pytest.raises(FakeNVML.NVMLError):
        topology._nvlink("0000:19:00.0")
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML({0: (2, None)}, error=FakeNVML.NVML_ERROR_NOT_SUPPORTED))
    assert topology._nvlink("0000:19:00.0") == NvLinkInfo((), 1)


def test_nvml_failure_is_reported_not_raised(monkeypatch, capsys):
    import pynvml

    def broken():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", broken)
    vers, notes = topology.versions()
    assert vers.driver is None and any(n.startswith("NVML:") and "Driver Not Loaded" in n for n in notes)
    monkeypatch.setattr(probe_cli, "launch_env", lambda: (0, 1, 0, None))
    assert probe_cli.main(["--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["versions"]["driver"] is None
    assert any("Driver Not Loaded" in n for n in rep["notes"])
    if torch.cuda.is_available():  # NVLink is NVML's too: unknown, with the reason
        assert all(g["nvlink"] is None for g in rep["gpus"])
        assert any("NVLink of GPU 0 (NVML)" in n for n in rep["notes"])


def test_versions_name_the_nccl_the_route_calls(monkeypatch, capsys):
    """The NCCL route calls commfuse.nccl's library, which may not be the one torch was built with: the probe
    reports that library's version, and torch's beside it where they differ."""
    from commfuse import nccl

    def missing():
        raise nccl.NcclUnavailable("no NCCL library could be loaded; tried loader path libnccl.so.2")

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 7))
    monkeypatch.setattr(nccl, "library", missing)
    vers, notes = topology.versions()
    assert vers.nccl is None and vers.torch_nccl == "2.27.7"
    assert any(n.startswith("NCCL route's library: NcclUnavailable: no NCCL library") for n in notes)
    monkeypatch.setattr(nccl, "library", lambda: types.SimpleNamespace(version=lambda: "2.28.9"))
    vers, _ = topology.versions()
    assert (vers.nccl, vers.torch_nccl) == ("2.28.9", "2.27.7")
    monkeypatch.setenv("COMMFUSE_NCCL", "0")  # the route calls torch.distributed: torch's NCCL is the route's
    assert topology.versions()[0].nccl == "2.27.7"
    monkeypatch.delenv("COMMFUSE_NCCL")
    monkeypatch.setattr(topology, "versions", lambda: (vers, ()))
    monkeypatch.setattr(probe_cli, "launch_env", lambda: (0, 1, 0, None))
    assert probe_cli.main([]) == 0
    assert "NCCL 2.28.9 (torch's: 2.27.7)," in capsys.readouterr().out


@pytest.mark.parametrize("strategy, noted", [("bogus", True), ("nccl", False)])
def test_probe_names_a_strategy_a_communicator_would_refuse(monkeypatch, capsys, strategy, noted):
    monkeypatch.setattr(probe_cli, "launch_env", lambda: (0, 1, 0, None))
    monkeypatch.setenv("COMMFUSE_STRATEGY", strategy)
    assert probe_cli.main(["--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["strategy"] == strategy
    assert any(f"COMMFUSE_STRATEGY='{strategy}' is not a strategy" in n for n in rep["notes"]) is noted, rep["notes"]


def test_group_probe_names_ranks_whose_settings_differ(monkeypatch, capsys):
    """The group probe prints rank 0's report; where another rank sets a setting that a Communicator's ranks compare
    differently (any of communicator.compared_settings, COMMFUSE_CHECK included, as the Communicator reads it), or
    to a value that is none, a Communicator would raise: the notes say so, naming the rank and the setting."""
    import torch.distributed as dist

    ranks = tuple(dataclasses.replace(gpu(device=i), versions=topology.own_info().versions) for i in range(2))
    topo = topology.Topology(0, 2, ranks, ((True, True), (True, True)), "p2p", ("2 ranks",))
    monkeypatch.setattr(probe_cli, "launch_env", lambda: (0, 2, 0, "mpi"))
    monkeypatch.setattr("commfuse.distributed.init_distributed", lambda timeout_s: (0, 2))
    monkeypatch.setattr(topology, "detect", lambda: topo)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # nothing of the test session's to destroy
    names = ("COMMFUSE_STRATEGY", "COMMFUSE_PRETEND_NO_P2P", "COMMFUSE_DISABLE_FUSION", "COMMFUSE_CHECK",
             "COMMFUSE_GLOO_CHECK", "COMMFUSE_GLOO_TIMEOUT_S", "COMMFUSE_NCCL_TIMEOUT_S")
    for k in names:
        monkeypatch.delenv(k, raising=False)
    for theirs, noted_with in (({"COMMFUSE_PRETEND_NO_P2P": "1"}, "COMMFUSE_PRETEND_NO_P2P: rank 0 False, rank 1 True"),
                               ({"COMMFUSE_STRATEGY": "twoshot"}, "strategy: rank 0 'auto', rank 1 'twoshot'"),
                               ({"COMMFUSE_CHECK": "1"}, "COMMFUSE_CHECK: rank 0 False, rank 1 True"),
                               ({"COMMFUSE_GLOO_TIMEOUT_S": "abc"}, "rank 1: COMMFUSE_GLOO_TIMEOUT_S must be a number"),
                               # What a Communicator reads as rank 0's unset values: no difference to note.
                               ({"COMMFUSE_STRATEGY": "auto", "COMMFUSE_DISABLE_FUSION": "0",
                                 "COMMFUSE_PRETEND_NO_P2P": "", "COMMFUSE_GLOO_TIMEOUT_S": "10"}, None)):
        with monkeypatch.context() as m:
            for k, v in theirs.items():
                m.setenv(k, v)
            other = probe_cli._settings()
        monkeypatch.setattr(probe_cli, "gather_objects", lambda group, mine: [mine, other])
        assert probe_cli.main(["--json"]) == 0
        notes = json.loads(capsys.readouterr().out)["notes"]
        noted = [n for n in notes if "a Communicator raises" in n]
        if noted_with is None:
            assert not noted, (theirs, notes)
        else:
            assert len(noted) == 1 and noted_with in noted[0], (theirs, notes)


def test_single_probe_notes_a_setting_a_communicator_refuses(monkeypatch, capsys):
    monkeypatch.setattr(probe_cli, "launch_env", lambda: (0, 1, 0, None))
    monkeypatch.setenv("COMMFUSE_GLOO_TIMEOUT_S", "abc")
    assert probe_cli.main(["--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("COMMFUSE_GLOO_TIMEOUT_S must be a number, got 'abc': a Communicator raises it" in n for n in notes)


def test_bus_ids_normalised():
    assert topology._norm_bus_id(b"00000000:3B:00.0\x00") == "0000:3b:00.0"
    assert topology._norm_bus_id("0001:c1:1f.7") == "0001:c1:1f.7"


# ---- ipc ------------------------------------------------------------------------------------------

def test_driver_errors_name_the_call():
    def cuFake():
        return (ipc.driver.CUresult.CUDA_ERROR_INVALID_VALUE,)

    with pytest.raises(ipc.CudaError, match=r"^cuFake failed: CUDA_ERROR_INVALID_VALUE") as e:
        ipc.call(cuFake)
    assert (e.value.call, e.value.code) == ("cuFake", "CUDA_ERROR_INVALID_VALUE")
    assert ipc.call(lambda: (ipc.driver.CUresult.CUDA_SUCCESS, 7)) == 7
    assert ipc.call(lambda: (ipc.driver.CUresult.CUDA_SUCCESS, 7, 8)) == (7, 8)
    with pytest.raises(ValueError, match="64 bytes"):
        ipc.open_handle(b"short")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-driver path: this machine has CUDA")
def test_missing_driver_is_a_cuda_error():
    with pytest.raises(ipc.CudaError, match="^cuInit failed"):
        ipc.device(0)
    with pytest.raises(ipc.CudaError, match="^cuMemAlloc failed"):
        ipc.alloc(16)


# ---- the probe command ----------------------------------------------------------------------------

def _run_probe(*args):
    return subprocess.run([sys.executable, "-m", "commfuse.cli.probe", *args], env=single_process_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_probe_text_runs():
    res = _run_probe()
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    assert "single process" in res.stdout and "COMMFUSE_PRETEND_NO_P2P=1" in res.stdout
    if torch.cuda.is_available():
        assert torch.cuda.get_device_name(0)[:23] in res.stdout
    else:
        assert "no CUDA GPU" in res.stdout and "mode of a Communicator in this process: cpu" in res.stdout


def test_probe_json_has_documented_fields():
    res = _run_probe("--json")
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert set(rep) == PROBE_FIELDS
    for key in PROBE_FIELDS:  # every field is documented in the module docstring
        assert re.search(rf"^  {key}\b", probe_cli.__doc__, re.M), key
    assert rep["launcher"] is None and rep["world_size"] == 1 and rep["matrix_of"] == "gpus"
    assert rep["p2p_ipc"] is None and rep["strategy"] == (os.environ.get("COMMFUSE_STRATEGY") or "auto")
    assert set(rep["overrides"]) == set(probe_cli.OVERRIDES)
    assert set(rep["versions"]) == {"torch", "cuda_runtime", "nccl", "torch_nccl", "driver", "driver_cuda"}
    assert rep["versions"]["torch"] == torch.__version__
    (me,) = rep["ranks"]
    assert set(me) == UNIT_FIELDS | {"rank", "host", "node", "versions"}
    assert me["host"] == socket.gethostname() == rep["host"]
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert rep["cuda"] is (n > 0) and len(rep["gpus"]) == n
    assert len(rep["p2p_driver"]) == len(rep["nvlink"]) == n
    if n == 0:
        assert rep["mode"] == "cpu" and rep["local_group"] is None
        assert set(me["fused"].values()) == {"separated"}
        assert any("no CUDA GPU" in x for x in rep["notes"])
    else:
        cap = torch.cuda.get_device_capability(0)
        assert rep["gpus"][0]["sm"] == f"{cap[0]}.{cap[1]}"
        assert rep["gpus"][0]["fused"] == fusion_capability(cap)
        assert set(rep["gpus"][0]) == UNIT_FIELDS
        assert rep["mode"] == "fallback" and rep["local_group"]["mode"] in ("p2p", "fallback")


def test_probe_says_separated_where_fusion_is_turned_off(monkeypatch):
    """COMMFUSE_DISABLE_FUSION=1: every pattern of a GPU that fuses them is "separated", as the routes run it."""
    monkeypatch.delenv("COMMFUSE_DISABLE_FUSION", raising=False)
    assert probe_cli._fused((9, 0)) == fusion_capability((9, 0)) != {p: "separated" for p in fusion_capability(None)}
    monkeypatch.setenv("COMMFUSE_DISABLE_FUSION", "1")
    assert probe_cli._fused((9, 0)) == {p: "separated" for p in fusion_capability(None)}
    assert probe_cli.render(dict(json.loads(_run_probe("--json").stdout), launcher="mpi")).startswith(
        f"commfuse-probe on {socket.gethostname()}: 1 rank (mpi)")


def test_probe_text_says_a_switch_not_at_1_does_nothing():
    """COMMFUSE_DISABLE_FUSION=true is listed as set, and as doing nothing (a switch reads only "1"), not as if it
    turned fusion off."""
    rep = json.loads(_run_probe("--json").stdout)
    rep["overrides"] = {"COMMFUSE_STRATEGY": "nccl", "COMMFUSE_PRETEND_NO_P2P": "1", "COMMFUSE_DISABLE_FUSION": "true"}
    text = probe_cli.render(rep)
    assert ("Overrides (COMMFUSE_STRATEGY=nccl, COMMFUSE_PRETEND_NO_P2P=1, COMMFUSE_DISABLE_FUSION=true (no effect: "
            "only 1 switches it on))") in text, text


# ---- single process on GPUs ---------------------------------------------------------------------

@two_gpus
def test_driver_p2p_and_nvlink_between_gpu0_and_gpu1():
    gpus = topology.local_gpus()
    assert [g.device for g in gpus] == list(range(torch.cuda.device_count()))
    assert len({g.pci_bus_id for g in gpus}) == len({g.uuid for g in gpus}) == len(gpus)
    driver, notes = topology.driver_p2p_matrix(gpus)
    assert driver[0][1] is True and driver[1][0] is True, notes
    links = topology.nvlink_matrix(gpus)
    assert links[0][1] > 0 and links[1][0] > 0, [g.notes for g in gpus]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CPU-only machine)")
def test_ipc_buffer_round_trip_on_gpu():
    data = bytes(range(256)) * 16
    with ipc.device_context(torch.cuda.current_device()):
        ptr = ipc.alloc(len(data))
        try:
            ipc.copy_to_device(ptr, data)
            assert ipc.copy_to_host(ptr, len(data)) == data
            handle = ipc.export_handle(ptr)
            assert len(handle) == ipc.HANDLE_BYTES and any(handle)
        finally:
            ipc.free(ptr)


# ---- multi-rank ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def world():
    import commfuse

    commfuse.init_distributed(timeout_s=float(os.environ.get("COMMFUSE_TEST_COLLECTIVE_TIMEOUT", 180)))
    return dist.group.WORLD


@pytest.fixture(scope="module")
def gloo_group(world):
    """WORLD when it is gloo, else a gloo group over the same ranks (so this runs on GPU machines too)."""
    return world if dist.get_backend(world) == "gloo" else dist.new_group(backend="gloo")


@pytest.mark.mpi(min_size=2)
def test_detection_is_dropped_with_its_group(world):
    group = dist.new_group(backend="gloo")
    topo = topology.detect(group)
    assert topology.detect(group) is topo
    entries = len(topology._DETECTED)
    dist.destroy_process_group(group)
    del group, topo
    gc.collect()
    assert len(topology._DETECTED) == entries - 1


@pytest.mark.mpi(min_size=2)
def test_gloo_group_is_cpu_mode(gloo_group):
    topo = topology.detect(gloo_group)
    assert topology.detect(gloo_group) is topo  # cached per group
    world, rank = dist.get_world_size(), dist.get_rank()
    assert (topo.world_size, topo.rank, len(topo.ranks)) == (world, rank, world)
    if topo.shared_gpu:  # ranks sharing one GPU (a one-GPU machine): the P2P row over same-device IPC
        assert topo.mode == "p2p" and "share GPU" in topo.reasons[-1], topo.reasons
        assert all(all(row) for row in topo.p2p_ipc), topo.notes
    else:
        assert topo.mode == "cpu"
    assert topo.ranks[rank].host == socket.gethostname()
    hosts: list = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=gloo_group)
    assert [r.host for r in topo.ranks] == hosts
    if not topo.shared_gpu:
        # nothing measured between ranks; the diagonal says True only for a rank with a GPU of its own (p2p too: a
        # rank without one reaches nothing, which the matrix said True of)
        assert topo.p2p == tuple(tuple(i == j and r.device is not None for j in range(world))
                                 for i, r in enumerate(topo.ranks))
        own = tuple(tuple(True if i == j and r.device is not None else None for j in range(world))
                    for i, r in enumerate(topo.ranks))
        assert topo.p2p_driver == topo.p2p_ipc == own, (topo.p2p_driver, topo.p2p_ipc)
        if not torch.cuda.is_available():
            assert all(v is None for row in topo.p2p_ipc for v in row)


def _gpu_world(world):
    if dist.get_backend(world) != "nccl" or torch.cuda.device_count() < 2:
        pytest.skip("needs an NCCL group over 2+ GPUs (mpirun -n 2 on the GPU machine)")


@pytest.mark.mpi(min_size=2)
def test_nccl_group_is_p2p_confirmed_by_ipc(world):
    _gpu_world(world)
    topo = topology.detect(world)
    n, rank = topo.world_size, topo.rank
    assert topo.mode == "p2p", (topo.reasons, topo.notes)
    assert topo.sm == torch.cuda.get_device_capability()
    if "H100" in topo.ranks[rank].gpu_name or "H200" in topo.ranks[rank].gpu_name:
        assert topo.sm == (9, 0)
    assert topo.ranks[rank].device == torch.cuda.current_device()
    for i in range(n):
        for j in range(n):
            if i != j:
                assert topo.p2p_driver[i][j] is True and topo.p2p_ipc[i][j] is True, topo.notes
                assert topo.nvlink[i][j] > 0, topo.notes
    assert all(all(row) for row in topo.p2p)
    assert len({r.pci_bus_id for r in topo.ranks}) == n  # one GPU per rank
    assert not [x for x in topo.notes if "IPC" in x]


@pytest.mark.mpi(min_size=2)
def test_pretend_no_p2p_gives_fallback_without_touching_the_cache(world, monkeypatch):
    _gpu_world(world)
    monkeypatch.setenv("COMMFUSE_PRETEND_NO_P2P", "1")
    fresh = topology.probe(world)
    assert fresh.mode == "fallback" and "COMMFUSE_PRETEND_NO_P2P" in fresh.reasons[0]
    assert all(all(row) for row in fresh.p2p)  # the hardware still has P2P: only the override changed
    monkeypatch.delenv("COMMFUSE_PRETEND_NO_P2P")
    assert topology.detect(world).mode == "p2p"


def test_pretend_no_p2p_is_read_at_each_detect(monkeypatch):
    """The cached topology keeps the facts, not the decision: a Communicator made with COMMFUSE_PRETEND_NO_P2P=1
    takes the fallback row, a later one of the same group without it the P2P row (it kept the first's)."""
    class Group:  # a group's stand-in (the cache holds its groups weakly)
        pass

    group, ranks, p2p = Group(), (gpu(device=0), gpu(device=1)), ((True, True), (True, True))
    monkeypatch.setattr(dist, "get_backend", lambda g: "nccl")
    monkeypatch.setenv("COMMFUSE_PRETEND_NO_P2P", "1")
    mode, reasons = decide_mode(ranks, p2p, True, "nccl")
    monkeypatch.setitem(topology._DETECTED, group, topology.Topology(0, 2, ranks, p2p, mode, reasons))
    assert topology.detect(group).mode == "fallback"
    monkeypatch.delenv("COMMFUSE_PRETEND_NO_P2P")
    again = topology.detect(group)
    assert again.mode == "p2p" and "2 ranks on one node" in again.reasons[0] and again.p2p == p2p


@pytest.mark.parametrize("gpus, expect", [
    (["GPU-a", "GPU-b"], "nccl"), (["GPU-a"], "nccl"),
    (["GPU-a", "GPU-a", "GPU-b", "GPU-b"], "gloo"),  # 4 ranks on 2 GPUs
    (["GPU-a", "GPU-b", "GPU-c", "GPU-a"], "gloo"),  # two ranks of different nodes' numbering on one GPU
    (["GPU-a", None], "gloo"), ([None, None], "gloo")])
def test_default_backend_is_gloo_where_ranks_share_a_gpu_or_one_has_none(gpus, expect):
    """By the ranks' GPU UUIDs: ranks that each see one GPU of their own (CUDA_VISIBLE_DEVICES=$LOCAL_RANK) on a
    node of more ranks than either sees take NCCL (counting ranks against visible GPUs gave gloo, then CPU mode)."""
    from commfuse.distributed import default_backend

    assert default_backend(gpus) == expect


def test_init_distributed_destroys_its_gloo_group_at_exit(tmp_path):
    """A process of its own (world 1, gloo): the group init_distributed made is gone when the interpreter's
    exit handlers run (a hook registered before it runs after it), and the process exits 0."""
    script = tmp_path / "exit.py"
    script.write_text(
        "import atexit, torch, torch.distributed as dist\n"
        "atexit.register(lambda: print('initialized at exit:', dist.is_initialized(), flush=True))\n"
        "import commfuse\n"
        "commfuse.init_distributed(backend='gloo')\n"
        "print(commfuse.Communicator().all_reduce(torch.ones(4)).sum().item(), flush=True)\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       env=single_process_env(CUDA_VISIBLE_DEVICES=""), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["4.0", "initialized", "at", "exit:", "False"], (r.stdout, r.stderr)


@pytest.mark.parametrize("shared", [False, True])
def test_probe_says_a_group_too_large_for_the_p2p_kernels_takes_the_collective(shared):
    """16 ranks on one P2P node: the node's mode is p2p, but the P2P kernels take at most MAX_WORLD ranks, so a
    Communicator of the group makes no workspace: the report says which collective it takes instead."""
    from commfuse.kernels.p2p_allreduce import MAX_WORLD

    n, versions = 2 * MAX_WORLD, topology.own_info().versions  # the report prints rank 0's
    ranks = tuple(dataclasses.replace(gpu("a", device=i % MAX_WORLD if shared else i), versions=versions)
                  for i in range(n))
    mode, reasons = decide_mode(ranks, full(n), backend="gloo" if shared else "nccl")
    topo = topology.Topology(0, n, ranks, tuple(map(tuple, full(n))), mode, reasons)
    rep = probe_cli.group_report(topo, "mpirun")
    assert rep["mode"] == "p2p"
    assert rep["reasons"][-1] == (f"{n} ranks > {MAX_WORLD}: no P2P kernels for it, no P2P workspace: a "
                                  f"Communicator of this group takes {'gloo' if shared else 'NCCL'}")
    small = probe_cli.group_report(topology.Topology(0, 2, ranks[:2], tuple(map(tuple, full(2))), "p2p", ("x",)),
                                   "mpirun")
    assert small["reasons"] == ["x"]


def test_single_probe_says_a_node_too_large_for_the_p2p_kernels_takes_nccl(monkeypatch):
    """The one-process probe's "local_group" (one rank per local GPU) of a node with more GPUs than the P2P kernels
    take, P2P between every pair: it says the group takes NCCL, as the group report does."""
    from commfuse.kernels.p2p_allreduce import MAX_WORLD

    n, versions = MAX_WORLD + 2, topology.own_info().versions
    gpus = tuple(dataclasses.replace(gpu("a", device=i), versions=versions) for i in range(n))
    monkeypatch.setattr(topology, "own_info", lambda: gpus[0])
    monkeypatch.setattr(topology, "local_gpus", lambda versions=None: gpus)
    monkeypatch.setattr(topology, "driver_p2p_matrix", lambda infos: (tuple(map(tuple, full(len(infos)))), ()))
    local = probe_cli.single_report()["local_group"]
    assert local["mode"] == "p2p"
    said = f"{n} ranks > {MAX_WORLD}: no P2P kernels for it, no P2P workspace: a Communicator of this group takes NCCL"
    assert said in local["reasons"], local


@pytest.mark.parametrize("gpus", [1, 2])
def test_single_probe_names_a_probe_sh_that_runs_the_ipc_check(monkeypatch, gpus):
    """The IPC check needs two processes: on a one-GPU machine the advice named `launch/probe.sh 1`, which runs one
    process again."""
    versions = topology.own_info().versions
    infos = tuple(dataclasses.replace(gpu("a", device=i), versions=versions) for i in range(gpus))
    monkeypatch.setattr(topology, "own_info", lambda: infos[0])
    monkeypatch.setattr(topology, "local_gpus", lambda versions=None: infos)
    monkeypatch.setattr(topology, "driver_p2p_matrix", lambda infos: (tuple(map(tuple, full(len(infos)))), ()))
    local = probe_cli.single_report()["local_group"]
    assert local["reasons"][-1] == "P2P from the driver only: the IPC check needs two processes (launch/probe.sh 2)"


def test_mig_instances_of_one_gpu_count_as_sharing_it():
    """Two MIG instances of one GPU have UUIDs of their own and one PCI bus id: NCCL refuses them as one GPU
    ("Duplicate GPU detected"), so init_distributed's default is gloo and the topology names them as sharing it.
    The driver is not asked for P2P from a GPU to itself (it answered True, asked nothing)."""
    from commfuse.distributed import default_backend

    mig = [RankInfo("a", 0, f"MIG-{i}", (9, 0), "sim MIG 1g.10gb", "0000:19:00.0", boot_id="b") for i in range(2)]
    assert topology.gpu_sharers(mig) == (2, 2)
    assert "ranks 0,1 share GPU 0" in topology.sharing_reason(mig)
    place = "|a|b|0000:19:00"
    assert default_backend([f"MIG-0{place}", f"MIG-1{place}"]) == "gloo"
    assert default_backend([f"GPU-0{place}", "GPU-1|a|b|0000:1a:00"]) == "nccl"
    assert default_backend([f"GPU-0{place}", "GPU-1|other|c|0000:19:00"]) == "nccl"  # the same bus on another node
    assert default_backend([f"MIG-0{place}", "MIG-1|container2|b|0000:19:00"]) == "gloo"  # one machine's containers
    assert default_backend(["GPU-0||b|", "GPU-1||b|"]) == "nccl"  # no bus id known: by the UUIDs
    assert topology.can_access_peer("0000:19:00.0", "0000:19:00.0") == (None, None)
