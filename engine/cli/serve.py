"""``aotx serve``: assemble and run the engine process in the foreground.

Owns: the start-up order (make the data dir private and check it is writable,
lock the socket, load the model stage by stage with one log line each, check the
configuration against the budget, recover the journal, start the tick thread,
serve the socket) and a clean stop on SIGTERM or SIGINT: the tick loop ends
after its current tick, every connection is closed by its own task before the
socket loop stops (no task is left pending to die with a traceback at exit),
and a second signal exits at once. One log line per notable event goes to
stderr. The engine runs with umask 077: every file it writes is its user's alone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from aotx.engine.backend.device import pick_device  # noqa: F401 (serve's device choice; bench and tests use it here)
from aotx.engine.errors import AdmissionError, AotxError, ModelError, UsageError

log = logging.getLogger("aotx.serve")

DEFAULT_SLOTS = 8
DEFAULT_CONTEXT = 4096


def media_profile(lm, device: str, vision=None):
    """The model's ``media.profile.MediaProfile`` (None when the media extra is not installed)."""
    try:
        from aotx.media.profile import profile_for

        return profile_for(lm, device=device, vision=vision)
    except Exception:  # noqa: BLE001 - media support is optional
        return None


def media_bytes(lm, device: str, vision=None) -> int:
    """Bytes the media routes loaded at start use: the vision encoder's weights and
    working memory (its route is "encoder"). The speech and OCR specialists load when
    a first attachment needs one, and admission counts them then (``Engine.count_media``):
    a text-only chat never pays for them. 0 without the media extra."""
    prof = media_profile(lm, device, vision)
    if prof is None:
        return 0
    return int(sum(r.memory_bytes for r in prof.routes if r.available and r.route == "encoder"))


def clamp_budget(total: int, device: str, asked: str | None) -> int:
    """``--memory-budget`` past what the machine has is clamped to it, and the log says so
    (unclamped, 500G on a 23 GiB machine sized 24.3 GiB of KV without a word)."""
    from aotx.engine.runtime import admission
    from aotx.engine.units import fmt_bytes

    have = admission.default_cuda_budget() if device == "cuda" else admission.machine_memory_bytes()
    if asked and total > have:
        where = "GPU memory (less 1 GiB for CUDA)" if device == "cuda" else "memory"
        log.warning("--memory-budget %s is more than this machine's %s of %s; using %s", asked, fmt_bytes(have),
                    where, fmt_bytes(have))
        return have
    return total


def load_vision(arg: str | None, lm, device: str):
    """The ``media.vision.VisionEncoder`` for ``--mmproj``: a path, "none" (images go
    through OCR), or None to use a file named ``mmproj*.gguf`` beside the model.

    Raises ModelError (exit 2) for a broken mmproj or one whose output width is not
    the text model's, MediaError when the vision packages are missing."""
    from aotx.engine.errors import ModelError

    if arg is not None and arg.strip().lower() == "none":
        return None
    try:
        from aotx.media.mmproj import find_mmproj
        from aotx.media.vision import VisionEncoder
    except ImportError as e:
        if arg is None:
            return None
        raise UsageError(f"--mmproj needs the media extra ({e.name} is missing): pip install 'aotx[media]'") from None
    path = Path(arg).expanduser() if arg else find_mmproj(lm.path)
    if path is None:
        return None
    if not path.is_file():
        raise UsageError(f"--mmproj {arg}: no such file (the vision projector GGUF, e.g. mmproj-model-f16.gguf)")
    enc = VisionEncoder.open(path, device=device)
    if enc.cfg.n_embd_out != lm.config.d_model:
        raise ModelError(f"{path}: the projector outputs {enc.cfg.n_embd_out}-wide embeddings, the text model "
                         f"{lm.path.name} is {lm.config.d_model} wide: they are not a pair (pass the mmproj made "
                         "for this model, or --mmproj none)")
    log.info("vision: %s (%s, %d x %d px -> %d positions per image)%s", path.name, enc.cfg.projector,
             enc.cfg.image_size, enc.cfg.image_size, enc.cfg.n_tokens, "" if arg else ", found beside the model")
    return enc


def keep_alive_seconds(text: str | None) -> float:
    """``--keep-alive`` (5m, 30s, 1h, 0 = never) in seconds; UsageError when unreadable."""
    from aotx.engine.units import parse_duration

    if text is None:
        return 0.0
    try:
        v = parse_duration(text)
    except ValueError:
        raise UsageError(f"--keep-alive: cannot read {text!r} as a duration (e.g. 5m, 30s, 1h; 0 = never)") from None
    return v


def load_beside(entry, device: str, asked: str | None, kv_type: str = "f16"):
    """Load a model (catalog ``entry``) beside the default one, on the engine's
    ``device``; when ``--device`` was ``asked`` auto and CUDA cannot run the file, on
    the CPU (the engine runs it there: ``Engine._make_local``). A mixture of experts
    keeps its routed experts on the CPU tier (no GPU expert cache is planned for it).
    On the CPU its first reply does not wait for kernels it is the first to need (other
    weight types): a child compiles their single-threaded twins while the weights are read,
    and the threaded ones compile in the background after the load (warmup.py)."""
    from aotx.engine.model.loader import load_model

    if device == "cpu":
        from aotx.engine.backend.cpu import warmup
        from aotx.engine.cli.startup import AheadWait
        from aotx.engine.model.warmup_ahead import start_ahead

        warmup.PARALLEL.ready = False
        try:
            return load_model(entry.path, device=device, tune="auto",
                              progress=AheadWait(start_ahead(entry.path, kv_type, force=True)))
        finally:
            warmup.start_background(log.info)
    try:
        return load_model(entry.path, device=device, tune="auto")
    except ModelError as e:
        if device != "cuda" or (asked or "auto") != "auto":
            raise
        log.warning("the CUDA backend cannot run %s (%s); it runs on the CPU", entry.name, e)
        return load_model(entry.path, device="cpu")


def place_experts(args, lm, device: str, budget, replan):
    """A mixture-of-experts model: calibrate, plan and place its experts in tiers
    (engine/model/experts.py) with the GPU budget that admission's table leaves (CUDA) or
    everything on the CPU tier; the stages go to the startup profile, the plan to the notes
    and the log. ``replan(cache_bytes)`` is the budget table with the cache. Returns it.
    Raises AdmissionError when the experts fit nowhere."""
    from aotx.engine.model import experts as X
    from aotx.engine.runtime import admission

    layers = X.moe_layers(lm.model.program)
    total = sum(L.n_expert * L.expert_bytes for L in layers)
    gpu = device == "cuda"
    gpu_bytes = max(0, budget.free - admission.EXPERT_CACHE_RESERVE) if gpu else 0
    ram = admission.machine_memory_bytes()
    host = ram // 2 if gpu else None
    st = X.setup(lm.model, model_fp=lm.fingerprint, gpu_bytes=gpu_bytes, host_bytes=host,
                 policy=getattr(args, "expert_cache", None) or "static")
    lines = admission.check_experts(st.plan, total, ram, gpu)
    lm.profile.update(st.stages)
    lm.notes["experts"] = st.note
    for line in lines:
        log.info("%s", line)
    return replan(st.plan.gpu_bytes) if gpu else budget


def build_engine(args, progress=None):
    """Load the model and build an Engine from parsed ``serve`` flags (not started).

    Returns (engine, store). Raises AotxError on any refusal."""
    from aotx.engine import paths
    from aotx.engine.model.loader import load_model
    from aotx.engine.runtime import admission
    from aotx.engine.runtime.drafter import DEFAULT_P_MIN, DraftModel, check_vocabulary_files
    from aotx.engine.runtime.engine import Engine
    from aotx.engine.runtime.store import open_store

    device = pick_device(args.device)
    keep_alive_seconds(getattr(args, "keep_alive", None))  # refuse a bad flag before loading anything
    if args.memory_budget:
        try:
            admission.parse_size(args.memory_budget)
        except ValueError:
            raise UsageError(f"--memory-budget: cannot read {args.memory_budget!r} as a size (e.g. 4G, 512M)") from None
    draft_path = getattr(args, "draft_model", None)
    if draft_path:  # refuse a mismatch before loading anything
        check_vocabulary_files(args.model, draft_path)
    try:
        lm = load_model(args.model, device=device, progress=progress, tune="auto")
    except ModelError as e:
        if device != "cuda" or args.device != "auto":
            raise
        # --device auto: a model the CUDA backend cannot run (a head size or tensor type it
        # lacks) still runs on the CPU; --device cuda asked for the GPU and gets the error
        log.warning("the CUDA backend cannot run this model (%s); running on the CPU", e)
        device = "cpu"
        lm = load_model(args.model, device=device, progress=progress)
    draft_lm = None
    if draft_path:
        draft_lm = load_model(draft_path, device=device)
        DraftModel.check_vocabulary(lm, draft_lm)
        log.info("draft model %s (%d layers, d_model %d)", draft_lm.name, draft_lm.config.n_layers,
                 draft_lm.config.d_model)
    speculative = getattr(args, "speculative", None) or ("draft" if draft_lm is not None else "auto")
    if speculative == "draft" and draft_lm is None:
        raise UsageError("--speculative draft needs --draft-model PATH")
    vision = load_vision(getattr(args, "mmproj", None), lm, device)
    from aotx.engine.runtime.media_prompt import DEFAULT_STORE_BYTES as image_store_bytes
    n_slots = args.slots or DEFAULT_SLOTS
    try:
        if args.memory_budget:
            total = clamp_budget(admission.parse_size(args.memory_budget), device, args.memory_budget)
        else:
            total = admission.default_cuda_budget() if device == "cuda" else admission.default_cpu_budget()
    except ValueError:
        raise UsageError(f"--memory-budget: cannot read {args.memory_budget!r} as a size (e.g. 4G, 512M)") from None
    kv_type = getattr(args, "kv_type", None) or "f16"
    try:
        lm.model.kv_cache_bytes(1, 1, kv_type)
    except ValueError as e:  # a KV type this backend or this model's head size does not take
        raise UsageError(f"--kv-type {kv_type}: {e}") from None
    prefill_chunk = getattr(args, "prefill_chunk", 256)
    journal_bytes = 8 << 20
    capsule_host = min(512 << 20, max(64 << 20, total // 16))
    # on CUDA the budget is the GPU's memory: parked capsules stay on the device up to a share
    # of it, and host-memory capsules live outside it
    capsule_device = min(2 << 30, total // 16) if device == "cuda" else 0
    media = media_bytes(lm, device, vision) + (image_store_bytes if vision else 0)

    def plan_for(n_ctx: int):
        return admission.plan(lm.config, lm.model.weight_bytes, lm.model.kv_cache_bytes(n_slots, n_ctx, kv_type),
                              n_slots, n_ctx, prefill_chunk, journal_bytes, total,
                              capsule_bytes=capsule_host if device != "cuda" else 0, media_bytes=media,
                              capsule_device_bytes=capsule_device,
                              prefill_weight_bytes=getattr(lm.model, "prefill_weight_bytes", 0),
                              draft_terms=DraftModel.budget_terms(draft_lm, n_slots, n_ctx) if draft_lm else (),
                              kv_type=kv_type)

    def fits(n_ctx: int) -> bool:
        try:
            plan_for(n_ctx)
            return True
        except AdmissionError:
            return False

    is_moe = bool(getattr(getattr(lm.model, "program", None), "moe_nodes", lambda: [])())
    # a mixture of experts keeps what the budget leaves for its expert cache: its default
    # context stays at DEFAULT_CONTEXT (or its trained one, when shorter)
    train = min(DEFAULT_CONTEXT, lm.config.n_ctx_train) if is_moe and not args.context else lm.config.n_ctx_train
    choice = admission.choose_context(args.context, train, fits,
                                      lambda s, n: lm.model.kv_cache_bytes(s, n, kv_type), n_slots, total, kv_type,
                                      model=lm.name)
    n_ctx = choice.n_ctx
    log.info("%s", choice.line)
    if choice.notice:  # said where the user looks: the clients' start, `aotx status`, the TUI
        log.warning("%s", choice.notice)
    kv_bytes = lm.model.kv_cache_bytes(n_slots, n_ctx, kv_type)
    budget = plan_for(n_ctx)
    ec = getattr(args, "expert_cache", None)
    if ec not in (None, "static") and not is_moe:
        # said, not refused: the flag is harmless here (llama.cpp's --n-cpu-moe on a dense file says nothing)
        who = getattr(lm.config, "name", "") or "the model"
        lm.notes["experts"] = f"--expert-cache {ec} has no effect: {who} has no mixture-of-experts layers"
        log.warning("%s", lm.notes["experts"])
    if is_moe:
        budget = place_experts(args, lm, device, budget, lambda cache: admission.plan(
            lm.config, lm.model.weight_bytes, kv_bytes, n_slots, n_ctx, prefill_chunk, journal_bytes, total,
            capsule_bytes=capsule_host if device != "cuda" else 0,
            media_bytes=media_bytes(lm, device, vision) + (image_store_bytes if vision else 0),
            capsule_device_bytes=capsule_device, prefill_weight_bytes=getattr(lm.model, "prefill_weight_bytes", 0),
            draft_terms=DraftModel.budget_terms(draft_lm, n_slots, n_ctx) if draft_lm else (), kv_type=kv_type,
            expert_cache_bytes=cache))
    from aotx.engine.state.cache import CapsuleCache

    no_journal = getattr(args, "no_journal", False)
    store = open_store(None if no_journal else paths.journal_dir(), buffer_bytes=journal_bytes)
    if choice.notice:
        store.notices.append(choice.notice)
    lm.notes["context"] = choice.line
    caps = CapsuleCache(None if no_journal else paths.capsules_dir() / lm.fingerprint, host_bytes=capsule_host,
                        fingerprint=lm.fingerprint, device_bytes=capsule_device, kv_type=kv_type)
    from aotx.engine.runtime.catalog import Catalog

    def load_entry(entry):
        return load_beside(entry, device, args.device, kv_type)

    eng = Engine(lm, store, n_slots=n_slots, n_ctx=n_ctx, prefill_chunk=prefill_chunk, budget=budget, device=device,
                 kv_type=kv_type, capsules=caps, speculative=speculative, draft_lm=draft_lm,
                 draft_p_min=DEFAULT_P_MIN if getattr(args, "draft_p_min", None) is None else args.draft_p_min,
                 catalog=Catalog(), loader=load_entry, capsule_root=None if no_journal else paths.capsules_dir(),
                 keep_alive_s=keep_alive_seconds(getattr(args, "keep_alive", None)),
                 evict_idle=bool(getattr(args, "evict_idle", False)),
                 context_policy=getattr(args, "context_policy", None) or "rolling")
    eng.submitter.media_profile = media_profile(lm, device, vision)  # specialists: counted when first used
    if vision is not None:
        from aotx.engine.runtime.media_prompt import ImageStore, special_wrap

        eng.vision = vision
        eng.images = ImageStore(wrap=special_wrap(lm.tokenizer, vision.cfg.projector))
    return eng, store


def restart_args(args, eng) -> list[str]:
    """The flags that start an engine like ``eng`` (built from ``serve``'s ``args``) again:
    its default model by absolute path (nothing for the installed default), draft model and
    projector by absolute path, and the sizing flags as they were given (a clamped
    ``--context`` is clamped again with its notice). Never the socket: a client passes its own."""
    from aotx.engine.model.loader import default_model_path
    from aotx.engine.errors import ModelError

    out: list[str] = []
    lm = eng.lm
    try:
        is_default = lm.path.resolve() == default_model_path().resolve()
    except ModelError:
        is_default = False
    if not is_default:
        out += ["--model", str(lm.path.resolve())]
    for flag, attr in (("--device", "device"), ("--slots", "slots"), ("--context", "context"),
                       ("--memory-budget", "memory_budget"), ("--kv-type", "kv_type"),
                       ("--expert-cache", "expert_cache"), ("--keep-alive", "keep_alive"),
                       ("--speculative", "speculative"), ("--draft-p-min", "draft_p_min")):
        v = getattr(args, attr, None)
        if v is not None and not (attr == "device" and v == "auto"):
            out += [flag, str(v)]
    for flag, attr in (("--draft-model", "draft_model"), ("--mmproj", "mmproj")):
        v = getattr(args, attr, None)
        if v:
            out += [flag, v if v == "none" else str(Path(v).expanduser().resolve())]
    if getattr(args, "evict_idle", False):
        out.append("--evict-idle")
    return out


def served_context(asked: int | None, n_ctx_train: int) -> int:
    """The context per slot ``--context`` gives a model (default DEFAULT_CONTEXT: the
    estimate of a model loaded beside the default, and ``aotx models``'), at most the
    model's trained context (past it its positions mean nothing). The default model's own
    is chosen from its trained context and the budget once it is loaded
    (``admission.choose_context``)."""
    want = asked or DEFAULT_CONTEXT
    return min(want, n_ctx_train) if n_ctx_train else want


def precheck(args, device: str) -> None:
    """What can be refused before the weights are read, refused then (one line, exit 2,
    in about a second instead of after the load): a journal another engine holds, and a
    configuration whose estimate from the file's header (weights, KV for --slots x
    --context, working buffers, tables, journal and capsule buffers) is over the budget on
    the CPU (the exact check after the load stays). ``--context`` past the model's trained
    context is said here, plainly, on its own line (it is clamped)."""
    from aotx.engine import paths
    from aotx.engine.errors import AdmissionError
    from aotx.engine.model.gguf_header import read_file_header
    from aotx.engine.model.loader import resolve_model_path
    from aotx.engine.runtime import admission
    from aotx.engine.runtime.catalog import estimate_terms
    from aotx.engine.units import fmt_bytes

    if not getattr(args, "no_journal", False):
        from aotx.engine.journal.directory import DirLock

        jdir = paths.journal_dir()
        jdir.mkdir(parents=True, exist_ok=True)
        DirLock(jdir).release()  # JournalError: "in use by another process; stop the running engine first"
    path = resolve_model_path(args.model)
    h = read_file_header(path)
    n_ctx = served_context(args.context, h.n_ctx_train)
    if args.context and n_ctx < args.context and sys.stderr.isatty():  # (a log's reader sees the log line)
        print(f"aotx: --context {args.context} is more than the {h.n_ctx_train} tokens {path.stem} was trained for: "
              f"using {n_ctx} (a longer context gives the model positions it never saw)", file=sys.stderr)
    if device != "cpu" or getattr(args, "draft_model", None):
        return  # CUDA's budget is the GPU's; a draft model is counted after both are read
    n_slots = args.slots or DEFAULT_SLOTS
    try:
        total = (admission.parse_size(args.memory_budget) if args.memory_budget else admission.default_cpu_budget())
    except ValueError:
        return  # build_engine says it in its words
    total = min(total, admission.machine_memory_bytes()) if args.memory_budget else total
    if not args.context:   # the default context is chosen after the load (admission.choose_context): refuse
        n_ctx = min(admission.CONTEXT_STEP, n_ctx)   # here only what no context could make fit
    kv_bytes = {"f32": 4, "q8_0": 34 / 32, "q4_0": 18 / 32}.get(getattr(args, "kv_type", None) or "f16", 2)
    terms = estimate_terms(h, n_slots, n_ctx, getattr(args, "prefill_chunk", 256), kv_bytes) + (
        ("journal buffers", 8 << 20), ("capsules (host)", min(512 << 20, max(64 << 20, total // 16))))
    need = sum(v for _, v in terms)
    if need > total:
        table = "\n".join(f"  {n:<16} {fmt_bytes(v):>10}  ({v:,} bytes)" for n, v in terms)
        raise AdmissionError(f"the configuration does not fit: {n_slots} slots x {n_ctx} tokens of context needs "
                             f"about {fmt_bytes(need)} ({need:,} bytes, estimated from {path.name}'s header; nothing "
                             f"was loaded), the budget is {fmt_bytes(total)} ({total:,} bytes):\n{table}\nlower "
                             f"--slots or --context, or raise --memory-budget")


class _Notices(logging.Handler):
    """Collects the warnings logged while the engine loads (``Welcome.notices``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def serve(args) -> int:
    """Run the engine until SIGTERM/SIGINT. Returns the exit code."""
    from aotx.engine import paths
    from aotx.engine import protocol as P
    from aotx.engine.ipc.server import Server, SocketLock, raise_fd_limit
    from aotx.engine.model import tool_calls

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s aotx %(message)s",
                        datefmt="%H:%M:%S")
    # onnxruntime (the OCR specialist) records usage telemetry unless told not to, and
    # reads the setting once, at its first import: set it before anything imports it
    os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
    os.umask(0o077)  # conversations, capsules and logs are private to the user
    pick_device(args.device)  # --device cuda without a GPU: its error line before anything is written
    check_data_dir()
    from aotx.engine.model.loader import check_model_arg, resolve_model_path

    if args.model:  # a bad --model: its one error line, not an engine announced first
        check_model_arg(args.model)
        resolve_model_path(args.model)
    sock = Path(args.socket).expanduser() if args.socket else paths.socket_path()
    # take the lock before the (slow) model load so a second engine fails fast
    lock = SocketLock(sock)
    lock.acquire()
    try:
        precheck(args, pick_device(args.device))  # refusals that need no weights, before any are read
    except BaseException:
        lock.release()
        raise
    log.info("engine pid %d, socket %s", os.getpid(), sock)
    said = _Notices()       # the load's warnings, for the Welcome of every client
    logging.getLogger("aotx").addHandler(said)
    from aotx.engine.backend.cpu import warmup

    # the first replies run on the kernels' single-threaded twins, which compile in a fraction of
    # the time; the threaded ones come from the cache, or compile in the background (warmup.py)
    warmup.PARALLEL.ready = False
    device = pick_device(args.device)
    from aotx.engine.model.loader import resolve_model_path

    # on a cold cache a child compiles the model's kernels while this process reads the weights
    from aotx.engine.cli.startup import StartupProgress, progress_paths

    from aotx.engine.model.warmup_ahead import start_ahead

    ahead = start_ahead(resolve_model_path(args.model), getattr(args, "kv_type", None) or "f16",
                        report=progress_paths(sock)[1]) if device == "cpu" else None
    progress = StartupProgress(sock, ahead)
    try:
        eng, store = build_engine(args, progress=progress)
    except BaseException:
        lock.release()
        raise
    finally:
        logging.getLogger("aotx").removeHandler(said)
        progress.close()
    lm = eng.lm
    log.info("model %s (%s, %d layers), device %s, %d slots x %d tokens", lm.name, lm.config.arch,
             lm.config.n_layers, eng.device, eng.n_slots, eng.n_ctx)
    log.info("budget: %d of %d bytes used\n%s", eng.budget.used, eng.budget.total, eng.budget.table())
    if store.recovery_note:
        log.info("%s", store.recovery_note)   # it begins "journal: "
    for line in store.notices:
        log.warning("%s", line)

    again = restart_args(args, eng)

    def welcome() -> P.Welcome:
        d = eng.models.default
        template = getattr(getattr(d, "lm", None), "template", None)
        return P.Welcome(protocol=P.PROTOCOL_VERSION, engine="aotx", model=eng.models.default_name,
                         device=eng.device, ready=eng.ready, pid=os.getpid(), journal=store.journaled,
                         draft_model=d.draft.lm.name if d is not None and d.draft else "",
                         models=list(eng.models.loaded), notices=said.lines[:8], engine_args=again,
                         tool_format=tool_calls.family_of(template.source) if template is not None else "hermes")

    # The socket server runs on an asyncio loop in a thread; the tick loop runs here, on
    # the main thread, where the model was loaded (see Engine.start for why).
    import threading

    raise_fd_limit()  # so the connection limit, not the descriptor limit, is what clients meet
    loop = asyncio.new_event_loop()
    server = Server(eng, sock, welcome, lock=lock)
    try:
        loop.run_until_complete(server.start())
    except AotxError as e:
        store.close()
        lock.release()
        print(f"aotx: {e}", file=sys.stderr)
        return 2
    net = threading.Thread(target=loop.run_forever, name="aotx-socket", daemon=True)
    net.start()
    log.info("serving on %s", sock)
    warmup.start_background(log.info)

    signals = []

    def on_signal(signum, frame) -> None:
        signals.append(signum)
        if len(signals) == 1:
            eng.request_stop()
            return
        # a second signal while the first is being honoured: leave now. Nothing durable
        # is lost (the journal survives kill -9); what was not yet receipted was never promised.
        os.write(2, b"aotx: second signal, exiting without waiting for the current tick\n")
        os._exit(1)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    eng.run()
    log.info("stopping")
    try:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(5)
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass
    loop.call_soon_threadsafe(loop.stop)
    net.join(5)
    if not net.is_alive():
        loop.close()
    try:
        store.close()
    except AotxError as e:  # e.g. the disk stayed full: what was never receipted is not on disk
        log.error("journal: %s", e)
        return 1
    return 0


def check_data_dir() -> None:
    """Before anything slow: the data dir exists, is writable (``StorageError``, one
    line, exit 2, for a read-only or foreign one) and is private: anything under it
    that other users could read is tightened, with a warning naming how many."""
    from aotx.engine import paths

    root = paths.data_dir()
    paths.check_writable(root)
    tightened, failed = paths.secure_data_dir(root)
    if tightened:
        log.warning("made %d path(s) under %s private (they were readable by other users), e.g. %s",
                    len(tightened), root, tightened[0])
    if failed:
        log.warning("%d path(s) under %s stay readable by other users (not owned by you?), e.g. %s; the data "
                    "dir itself is private", len(failed), root, failed[0])
