"""`python -m benchmarks wire`: Forward and Forward+Backward round trip, our gRPC stage vs hivemind's RemoteExpert.

Both sides host the same torch module over loopback (127.0.0.1), each server in its own process
(spawned; torch pinned to one thread in every process, the client included):

- ours: `peer.service.start_server` in front of a `StageWorker` serving a middle stage, called
  with `swarm.client.StageClient`; the codec is the run's `wire.codec` (responses) and the one
  the client encodes its requests with.
- hivemind: a `hivemind.moe.server.Server` with one `ModuleBackend` per (module, codec), called
  through `hivemind.moe.client.RemoteExpert` (hivemind's p2p: client p2pd -> server p2pd over TCP
  loopback); the codec is the `BatchTensorDescriptor` compression of inputs, outputs and grads.

Modules: "noop" (a middle stage with no blocks: the identity, so the transport alone) and
"block" (a middle stage holding exactly one transformer block of the config, rotary tables
included: [B, T, D] -> [B, T, D]). Weights are identical on both sides (deterministic init).

Neither side takes an optimizer step during the benchmark (hivemind: optimizer=None; ours:
training.global_batch set out of reach), so both only compute and accumulate gradients.

TLS rows: the same worker of ours is also served over mutual TLS (a second server, with a member
certificate of a run CA made for the benchmark; the client presents one too and checks the server's
peer id, as a trainer in a run with a coordinator does), and each call is timed over TLS and over
plaintext, alternated, so that the ratio tls / plaintext is the cost of the encryption alone.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from benchmarks.results import append_row
from swarm.config import RunConfig, load_config
from swarm.model import Stage

SECTION = "wire: Forward / Forward+Backward round trip, ours vs hivemind RemoteExpert"
COLUMNS = [
    "module",
    "codec",
    "activation",
    "ours fwd ms",
    "hivemind fwd ms",
    "ratio fwd",
    "ours fwd+bwd ms",
    "hivemind fwd+bwd ms",
    "ratio fwd+bwd",
    "notes",
]
MODULES = ("noop", "block")
CODECS = ("none", "fp16", "bf16", "int8")
GOALS = {"noop": 0.3, "block": 0.7}  # wanted: ours / hivemind at most this
STAGE = 1  # the middle stage of a 3-stage cut: [B, T, D] in and out
HIVEMIND_MAX_BATCH = 64  # examples per hivemind batch (>= one request; a lone request is never held back)

TLS_SECTION = "wire TLS: Forward / Forward+Backward round trip of our stage service, mutual TLS vs plaintext"
TLS_COLUMNS = [
    "module",
    "codec",
    "activation",
    "plaintext fwd ms",
    "tls fwd ms",
    "ratio fwd",
    "plaintext fwd+bwd ms",
    "tls fwd+bwd ms",
    "ratio fwd+bwd",
    "notes",
]
TLS_GOAL = 1.10  # wanted: tls / plaintext at most this, for one block's Forward+Backward
TLS_GOAL_MODULE = "block"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/small.toml", help="model of the 'block' module")
    p.add_argument("--reps", type=int, default=30, help="timed round trips per measurement")
    p.add_argument("--warmup", type=int, default=5, help="untimed round trips before each measurement")
    p.add_argument("--codecs", default=",".join(CODECS), help=f"comma-separated subset of {','.join(CODECS)}")
    p.add_argument("--modules", default=",".join(MODULES), help=f"comma-separated subset of {','.join(MODULES)}")
    p.add_argument("--batch", type=int, default=8, help="activation [batch, seq_len, d_model]")
    p.add_argument("--seq-len", type=int, default=None, help="default: the config's model.seq_len")
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="ours: serve.cache_size = 0, so Backward recomputes the forward like hivemind does",
    )


# -- the module and run config, shared by both sides ------------------------------------------


def bench_run(config: str, codec: str, cache: bool = True) -> RunConfig:
    """The config cut into 3 stages with exactly one block in the middle one, at `codec`."""
    run = load_config(config)
    n = run.model.n_layers
    if n < 3:
        raise SystemExit(f"{config}: needs at least 3 layers (a middle stage with one block)")
    data = run.with_stages(3, [1, 1, n - 2]).model_dump()
    data["wire"]["codec"] = codec
    # No optimizer step within the benchmark (hivemind's side runs without an optimizer too).
    data["training"]["global_batch"] = data["training"]["micro_batch"] * 10**6
    if not cache:
        data["serve"]["cache_size"] = 0
    return RunConfig.model_validate(data)


def build_module(run: RunConfig, kind: str) -> Stage:
    stage = Stage(run, STAGE)
    if kind == "noop":
        stage.layers = nn.ModuleDict()  # a middle stage without blocks is the identity
    return stage


class Hosted(nn.Module):
    """What hivemind hosts: the stage, taking and returning [B, T, D]; in bf16 on the wire if asked
    (hivemind has no bf16 codec: the tensors themselves are bf16 and travel uncompressed)."""

    def __init__(self, inner: nn.Module, bf16: bool):
        super().__init__()
        self.inner, self.bf16 = inner, bf16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bf16:
            return self.inner(x.float()).to(torch.bfloat16)
        return self.inner(x)


# -- hivemind's codec for each of ours --------------------------------------------------------


def _import_hivemind():
    # hivemind's efficient bf16 mode (without it, bfloat16 tensors travel as float32); read once
    # when hivemind.compression is imported, so set before the first import in every process.
    os.environ["USE_LEGACY_BFLOAT16"] = "0"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import hivemind  # noqa: F401
    import hivemind.compression as hc

    if hc.base.USE_LEGACY_BFLOAT16:
        raise RuntimeError("hivemind was imported before USE_LEGACY_BFLOAT16=0 could take effect")
    return hc


def hivemind_int8_error() -> str | None:
    """Why hivemind's 8-bit codecs cannot be used here, or None when UNIFORM_8BIT round-trips."""
    hc = _import_hivemind()
    from hivemind.proto.runtime_pb2 import CompressionType

    try:
        t = torch.randn(4, 256)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's deprecation of quantize_per_tensor
            back = hc.deserialize_torch_tensor(hc.serialize_torch_tensor(t, CompressionType.UNIFORM_8BIT))
        if back.shape != t.shape:
            return "UNIFORM_8BIT returned the wrong shape"
    except Exception as err:  # noqa: BLE001 - any failure means: not usable
        return f"UNIFORM_8BIT fails: {type(err).__name__}: {str(err).splitlines()[0]}"
    return None


def hivemind_codec(codec: str, int8_ok: bool) -> str:
    """Which codec hivemind runs in the row for our `codec` (int8 falls back to fp16 when broken)."""
    return "fp16" if codec == "int8" and not int8_ok else codec


def _compression(codec: str):
    from hivemind.proto.runtime_pb2 import CompressionType

    return {
        "none": CompressionType.NONE,
        "bf16": CompressionType.NONE,
        "fp16": CompressionType.FLOAT16,
        "int8": CompressionType.UNIFORM_8BIT,
    }[codec]


def expert_uid(kind: str, codec: str) -> str:
    return f"{kind}_{codec}.0"


# -- the two servers, each in its own spawned process ------------------------------------------


def _ours_main(config: str, pairs: list[tuple[str, str]], cache: bool, ca_dir: str, conn) -> None:
    """Each worker behind two servers: plaintext and mutual TLS (a peer certificate of the CA kept in
    `ca_dir`). Sends the ports, (plaintext, tls) per pair, and the peer id the TLS servers present."""
    torch.set_num_threads(1)
    from coordinator.ca import RunCA
    from peer.service import start_server
    from peer.worker import StageWorker

    servers, workers = [], []
    try:
        member = RunCA.load_or_create(Path(ca_dir), bench_run(config, "none").run_id).member("peer")
        ports = {}
        for kind, codec in pairs:
            worker = StageWorker(bench_run(config, codec, cache), STAGE, torch.device("cpu"))
            workers.append(worker)
            if kind == "noop":
                worker.stage.layers = nn.ModuleDict()
            plain, _, plain_port = start_server(worker, "127.0.0.1", 0)
            tls, _, tls_port = start_server(worker, "127.0.0.1", 0, member=member)
            servers += [plain, tls]
            ports[(kind, codec)] = (plain_port, tls_port)
        conn.send(("ok", (ports, member.peer_id)))
    except Exception as err:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(err).__name__}: {err}"))
    with contextlib.suppress(EOFError):
        conn.recv()  # until told to stop (or the parent goes away)
    for server in servers:
        server.stop(grace=None)
    for worker in workers:
        worker.close()


def _hivemind_main(config: str, pairs: list[tuple[str, str]], shape: tuple[int, ...], conn) -> None:
    torch.set_num_threads(1)
    _import_hivemind()
    from hivemind.moe import ModuleBackend, Server
    from hivemind.utils.tensor_descr import BatchTensorDescriptor

    from swarm.records import started_dht

    server = None
    try:
        dht = started_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        backends = {}
        run = bench_run(config, "none")
        for kind, codec in pairs:
            bf16 = codec == "bf16"
            desc = BatchTensorDescriptor(
                *shape[1:], dtype=torch.bfloat16 if bf16 else torch.float32, compression=_compression(codec)
            )
            uid = expert_uid(kind, codec)
            backends[uid] = ModuleBackend(
                name=uid,
                module=Hosted(build_module(run, kind), bf16),
                optimizer=None,
                args_schema=(desc,),
                outputs_schema=desc,
                # TaskPool: dispatch as soon as min_batch_size examples are queued and the queue is
                # empty, so a lone request goes straight to the runtime; `timeout` only bounds the
                # wait while below min_batch_size (never, with 1).
                min_batch_size=1,
                max_batch_size=HIVEMIND_MAX_BATCH,
                timeout=None,
            )
        server = Server(dht, backends, num_connection_handlers=1, start=True)
        conn.send(("ok", (dht.peer_id.to_bytes(), [str(a) for a in dht.get_visible_maddrs()])))
    except Exception as err:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(err).__name__}: {err}"))
    with contextlib.suppress(EOFError):
        conn.recv()  # until told to stop (or the parent goes away)
    if server is not None:
        server.shutdown()
        server.join(timeout=30)


class Child:
    """A spawned server process and the pipe that tells it to stop."""

    def __init__(self, name: str, target: Callable, *args):
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child_conn = ctx.Pipe()
        # Not daemonic: hivemind's server starts processes of its own.
        self.proc = ctx.Process(target=target, args=(*args, child_conn), name=name)
        self.proc.start()
        child_conn.close()

    def ready(self, timeout: float = 180.0):
        if not self.conn.poll(timeout):
            raise RuntimeError(f"{self.name}: not ready after {timeout:.0f} s")
        try:
            status, payload = self.conn.recv()
        except EOFError:
            status, payload = "error", f"exited with code {self.proc.exitcode}"
        if status != "ok":
            raise RuntimeError(f"{self.name}: failed to start: {payload}")
        return payload

    def stop(self, timeout: float = 60.0) -> None:
        with contextlib.suppress(OSError):  # the child may be gone already
            self.conn.send("stop")
        self.proc.join(timeout)
        if self.proc.is_alive():
            print(f"  {self.name} did not stop in {timeout:.0f} s: terminating it", flush=True)
            self.proc.terminate()
            self.proc.join(10)
        self.conn.close()


# -- the calls being timed -------------------------------------------------------------------


def ours_forward(client, x: torch.Tensor, codec: str, mb: str) -> torch.Tensor:
    from swarm.wire import decode, encode

    resp = client.forward(STAGE, encode(x, codec), mb, 0, train=False)
    return decode(resp.output)


def ours_fwd_bwd(client, x: torch.Tensor, g: torch.Tensor, codec: str, mb: str):
    from swarm.wire import decode, encode

    inputs = encode(x, codec)
    out = decode(client.forward(STAGE, inputs, mb, 0, train=True).output)
    grad = decode(client.backward(STAGE, inputs, encode(g, codec), mb, 0).input_grad)
    return out, grad


def hm_forward(expert, x: torch.Tensor, codec: str) -> torch.Tensor:
    with torch.no_grad():
        return expert(x.to(torch.bfloat16) if codec == "bf16" else x).float()


def hm_fwd_bwd(expert, x: torch.Tensor, g: torch.Tensor, codec: str):
    xin = (x.to(torch.bfloat16) if codec == "bf16" else x.detach()).requires_grad_(True)
    out = expert(xin)
    out.backward(g.to(out.dtype))
    return out.float(), xin.grad.float()


class Failures:
    """Calls that raised: retried (and left out of the timings), counted per side for the report."""

    def __init__(self, limit: int, sides: tuple[str, str] = ("ours", "hivemind")):
        self.limit, self.sides = limit, sides
        self.count = dict.fromkeys(sides, 0)
        self.last = dict.fromkeys(sides, "")

    def call(self, side: str, f: Callable, *args) -> tuple[object, float]:
        """f(*args) and its duration in ms, retrying a failed call (up to `limit` failures per side)."""
        while True:
            start = time.perf_counter()
            try:
                result = f(*args)
            except Exception as err:  # noqa: BLE001 - counted, shown, retried
                self.count[side] += 1
                self.last[side] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                print(f"    {side} call failed ({self.count[side]}): {self.last[side]}", flush=True)
                if self.count[side] > self.limit:
                    raise
                continue
            return result, (time.perf_counter() - start) * 1e3

    def note(self) -> str:
        return "; ".join(
            f"{side}: {n} failed call(s) retried, left out of the timings (last: {self.last[side]})"
            for side, n in self.count.items()
            if n
        )


def timed_pair(fa: Callable, fb: Callable, warmup: int, reps: int, failures: Failures) -> tuple[float, float]:
    """Median ms of `fa` and `fb` (the first and second of `failures.sides`), interleaved (alternating
    which goes first)."""
    a, b = failures.sides
    for i in range(warmup):
        failures.call(a, fa, -1 - 2 * i)
        failures.call(b, fb, -2 - 2 * i)
    ta, tb = [], []
    for i in range(reps):
        order = [(a, fa, ta), (b, fb, tb)]
        for side, f, times in order if i % 2 == 0 else order[::-1]:
            times.append(failures.call(side, f, i)[1])
    return statistics.median(ta), statistics.median(tb)


# -- the benchmark ----------------------------------------------------------------------------


def _subset(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise SystemExit(f"--{what}: {', '.join(bad) or '(empty)'} not in {', '.join(allowed)}")
    return items


def run(args: argparse.Namespace) -> str:
    codecs = _subset(args.codecs, CODECS, "codecs")
    kinds = _subset(args.modules, MODULES, "modules")
    base = bench_run(args.config, "none")
    shape = (args.batch, args.seq_len or base.model.seq_len, base.model.d_model)
    act = f"[{','.join(map(str, shape))}] f32"
    cache = not args.no_cache
    torch.set_num_threads(1)

    _import_hivemind()  # before anything else imports it: USE_LEGACY_BFLOAT16=0 must take effect
    from coordinator.ca import RunCA

    # A run CA for the TLS rows, made here before the server process loads it (it certifies its peer).
    ca_dir = tempfile.TemporaryDirectory(prefix="swarm-wire-ca-")
    trainer = RunCA.load_or_create(Path(ca_dir.name), base.run_id).member("trainer")
    int8_error = hivemind_int8_error() if "int8" in codecs else None
    load = os.getloadavg()[0]
    hm_of = {c: hivemind_codec(c, int8_error is None) for c in codecs}
    ours_pairs = [(k, c) for k in kinds for c in codecs]
    hm_pairs = [(k, c) for k in kinds for c in dict.fromkeys(hm_of.values())]

    print(
        f"wire: activation {act}, {args.warmup} warmup + {args.reps} timed round trips each "
        f"(1-min load average {load:.1f} on {os.cpu_count()} cores at start)",
        flush=True,
    )
    if int8_error:
        print(f"  hivemind int8: {int8_error}; our int8 is compared with hivemind fp16", flush=True)
    print(
        "  starting our stage servers (plaintext and mutual TLS) and hivemind's server "
        "(spawned, 1 torch thread each) ...",
        flush=True,
    )
    children: list[Child] = []
    hm_dht = experts = None
    clients = []
    rows, summary, tls_summary = [], [], []
    try:
        ours_child = Child("ours-server", _ours_main, args.config, ours_pairs, cache, ca_dir.name)
        children.append(ours_child)
        hm_child = Child("hivemind-server", _hivemind_main, args.config, hm_pairs, shape)
        children.append(hm_child)
        ports, server_peer_id = ours_child.ready()
        peer_bytes, maddrs = hm_child.ready()

        # hivemind's client first: its DHT forks, which must happen before any gRPC channel exists.
        from hivemind.moe.client.expert import create_remote_experts
        from hivemind.moe.expert_uid import ExpertInfo
        from hivemind.p2p import PeerID

        from swarm.records import started_dht

        hm_dht = started_dht(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True)
        peer = PeerID(peer_bytes)
        infos = [ExpertInfo(expert_uid(k, c), peer) for k, c in hm_pairs]
        experts = dict(zip(hm_pairs, create_remote_experts(infos, hm_dht), strict=True))
        for expert in experts.values():
            _ = expert.info  # fetch the schema once, outside the timings

        from swarm.client import StageClient

        channels, tls_channels = {}, {}
        for pair in ours_pairs:
            pair_run = bench_run(args.config, pair[1], cache)
            plain_port, tls_port = ports[pair]
            channels[pair] = StageClient(f"127.0.0.1:{plain_port}", pair_run)
            tls_channels[pair] = StageClient(f"127.0.0.1:{tls_port}", pair_run, member=trainer, peer_id=server_peer_id)
            clients += [channels[pair], tls_channels[pair]]

        gen = torch.Generator().manual_seed(0)
        x = torch.randn(shape, generator=gen)
        g = torch.randn(shape, generator=gen) * 1e-3
        run_cfg = bench_run(args.config, "none")
        for kind in kinds:
            reference = build_module(run_cfg, kind)
            xr = x.clone().requires_grad_(True)
            ref_out = reference(xr)
            ref_out.backward(g)
            for codec in codecs:
                hc = hm_of[codec]
                client, expert = channels[(kind, codec)], experts[(kind, hc)]
                label = f"{kind:5s} {codec:4s}" + (f" (hivemind {hc})" if hc != codec else "")

                # Sanity: both sides compute the same thing (to the codec's precision).
                failures = Failures(limit=max(3, args.reps // 5))
                (o_ours, gi_ours), _ = failures.call("ours", ours_fwd_bwd, client, x, g, codec, "check")
                (o_hm, gi_hm), _ = failures.call("hivemind", hm_fwd_bwd, expert, x, g, hc)
                err = {
                    "ours out": (o_ours - ref_out).abs().max().item(),
                    "hm out": (o_hm - ref_out).abs().max().item(),
                    "ours grad": (gi_ours - xr.grad).abs().max().item(),
                    "hm grad": (gi_hm - xr.grad).abs().max().item(),
                }
                print(f"  {label}: max |err| vs local " + ", ".join(f"{k} {v:.1e}" for k, v in err.items()))
                if codec == "none" and max(err.values()) > 1e-4:
                    print("  WARNING: codec none should match the local module: the two sides differ")

                print(f"  {label}: Forward ...", flush=True)
                f_ours, f_hm = timed_pair(
                    lambda i, c=client, cd=codec: ours_forward(c, x, cd, f"f{i}"),
                    lambda i, e=expert, cd=hc: hm_forward(e, x, cd),
                    args.warmup,
                    args.reps,
                    failures,
                )
                print(f"  {label}: Forward+Backward ...", flush=True)
                fb_ours, fb_hm = timed_pair(
                    lambda i, c=client, cd=codec: ours_fwd_bwd(c, x, g, cd, f"fb{i}"),
                    lambda i, e=expert, cd=hc: hm_fwd_bwd(e, x, g, cd),
                    args.warmup,
                    args.reps,
                    failures,
                )
                r_f, r_fb = f_ours / f_hm, fb_ours / fb_hm
                goal = GOALS[kind]
                notes = [
                    f"goal ratio <= {goal}: fwd {'met' if r_f <= goal else 'not met'}, "
                    f"fwd+bwd {'met' if r_fb <= goal else 'not met'}"
                ]
                if hc != codec:
                    notes.append(f"hivemind int8 n/a ({int8_error}): compared with hivemind {hc}")
                if codec == "bf16":
                    notes.append("hivemind bf16: bf16 tensors, CompressionType.NONE, USE_LEGACY_BFLOAT16=0")
                notes.append(
                    "ours Backward reuses the Forward's cached graph, hivemind recomputes"
                    if cache
                    else "ours cache off: both recompute the forward in backward"
                )
                if failures.note():
                    notes.append(failures.note())
                notes.append(
                    f"median of {args.reps}, loopback, 1 torch thread per process, no optimizer step, "
                    f"hivemind min_batch_size=1 max_batch_size={HIVEMIND_MAX_BATCH} timeout=None; "
                    f"load avg {load:.1f} at start"
                )
                values = [
                    kind,
                    codec,
                    act,
                    f"{f_ours:.2f}",
                    f"{f_hm:.2f}",
                    f"{r_f:.2f}",
                    f"{fb_ours:.2f}",
                    f"{fb_hm:.2f}",
                    f"{r_fb:.2f}",
                    "; ".join(notes),
                ]
                rows.append(append_row(SECTION, COLUMNS, values))
                ok = "ok" if max(r_f, r_fb) <= goal else "MISSED"
                cells = [kind, codec, hc, f_ours, f_hm, r_f, fb_ours, fb_hm, r_fb]
                summary.append(([*cells, f"{ok} {goal}"], failures.note() and f"{kind} {codec}: {failures.note()}"))
                print(
                    f"  {label}: fwd {f_ours:.2f} vs {f_hm:.2f} ms (x{r_f:.2f}), "
                    f"fwd+bwd {fb_ours:.2f} vs {fb_hm:.2f} ms (x{r_fb:.2f})",
                    flush=True,
                )
                row, line = measure_tls(
                    client, tls_channels[(kind, codec)], kind, codec, x, g, (o_ours, gi_ours), args, act, load
                )
                rows.append(row)
                tls_summary.append(line)
    finally:
        for client in clients:
            client.close()
        if experts:
            # Close the client's p2p replica on its own loop (else its finalizers complain at exit).
            from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker

            RemoteExpertWorker.run_coroutine(next(iter(experts.values())).p2p.shutdown())
        if hm_dht is not None:
            hm_dht.shutdown()
        for child in reversed(children):
            child.stop()
        ca_dir.cleanup()

    _print_table(
        f"median round trip, ms ({act}); ratio = ours / hivemind; goal <= 0.3 (noop), <= 0.7 (block)",
        ("module", "codec", "hivemind", "ours fwd", "hm fwd", "ratio", "ours f+b", "hm f+b", "ratio", "goal"),
        summary,
    )
    _print_table(
        f"median round trip, ms ({act}); ratio = tls / plaintext; goal <= {TLS_GOAL} ({TLS_GOAL_MODULE} fwd+bwd)",
        ("module", "codec", "plain fwd", "tls fwd", "ratio", "plain f+b", "tls f+b", "ratio", "goal"),
        tls_summary,
    )
    return "\n".join(rows)


def measure_tls(
    plain,
    tls,
    kind: str,
    codec: str,
    x: torch.Tensor,
    g: torch.Tensor,
    reference: tuple,
    args: argparse.Namespace,
    act: str,
    load: float,
) -> tuple[str, tuple[list, str]]:
    """The TLS row of one (module, codec): the same worker called through `plain` and `tls` (its
    plaintext and mutual-TLS servers), alternated. `reference`: the plaintext output and input grad.
    Returns the row and its line of the summary table."""
    label = f"{kind:5s} {codec:4s}"
    failures = Failures(limit=max(3, args.reps // 5), sides=("plaintext", "tls"))
    (out, grad), _ = failures.call("tls", ours_fwd_bwd, tls, x, g, codec, "tls-check")
    if not (torch.equal(out, reference[0]) and torch.equal(grad, reference[1])):
        print(f"  WARNING: {label}: the worker answered differently over TLS than over plaintext")
    print(f"  {label}: Forward, plaintext vs TLS ...", flush=True)
    f_plain, f_tls = timed_pair(
        lambda i: ours_forward(plain, x, codec, f"plain-f{i}"),
        lambda i: ours_forward(tls, x, codec, f"tls-f{i}"),
        args.warmup,
        args.reps,
        failures,
    )
    print(f"  {label}: Forward+Backward, plaintext vs TLS ...", flush=True)
    fb_plain, fb_tls = timed_pair(
        lambda i: ours_fwd_bwd(plain, x, g, codec, f"plain-fb{i}"),
        lambda i: ours_fwd_bwd(tls, x, g, codec, f"tls-fb{i}"),
        args.warmup,
        args.reps,
        failures,
    )
    r_f, r_fb = f_tls / f_plain, fb_tls / fb_plain
    if kind == TLS_GOAL_MODULE:
        goal = f"goal ratio <= {TLS_GOAL} for fwd+bwd: {'met' if r_fb <= TLS_GOAL else 'not met'}"
        met = f"{'ok' if r_fb <= TLS_GOAL else 'MISSED'} {TLS_GOAL}"
    else:
        met = "-"
        goal = f"no goal (the transport alone; goal ratio <= {TLS_GOAL} is for one {TLS_GOAL_MODULE}'s fwd+bwd)"
    notes = [
        goal,
        "one worker behind a plaintext and a mutual-TLS server (run CA EC P-256, member keys RSA-2048; "
        "the client checks the server's peer id), calls alternated",
    ]
    if failures.note():
        notes.append(failures.note())
    notes.append(
        f"median of {args.reps}, loopback, 1 torch thread per process, no optimizer step; load avg {load:.1f} at start"
    )
    values = [kind, codec, act, *(f"{v:.2f}" for v in (f_plain, f_tls, r_f, fb_plain, fb_tls, r_fb)), "; ".join(notes)]
    row = append_row(TLS_SECTION, TLS_COLUMNS, values)
    print(
        f"  {label}: fwd {f_tls:.2f} vs {f_plain:.2f} ms plaintext (x{r_f:.2f}), "
        f"fwd+bwd {fb_tls:.2f} vs {fb_plain:.2f} ms plaintext (x{r_fb:.2f})",
        flush=True,
    )
    cells = [kind, codec, f_plain, f_tls, r_f, fb_plain, fb_tls, r_fb, met]
    return row, (cells, failures.note() and f"{kind} {codec}: {failures.note()}")


def _print_table(title: str, head: tuple[str, ...], lines: list[tuple[list, str]]) -> None:
    """A summary table: `lines` are (cells, a note or ""); numbers are printed with 2 decimals."""
    print(f"\n{title}")
    print("  ".join(f"{h:>9s}" for h in head))
    for cells, _ in lines:
        print("  ".join(f"{c:>9.2f}" if isinstance(c, float) else f"{c:>9s}" for c in cells))
    notes = [f"  {note}" for _, note in lines if note]
    print("\n".join([*notes, ""]))
