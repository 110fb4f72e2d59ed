"""Commands that study a model: ``layers`` (per-layer statistics and CKA of one text), ``probe`` (linear
probes per layer on CoNLL-U labels), ``probe-over-time`` (the same across a pre-training run's snapshots), ``map`` (2-D maps per layer), ``fill`` (masked-LM predictions and the
logit lens), ``parity`` (per-layer differences against transformers or another checkpoint) and ``inspect``
(parameters, FLOPs, memory). The work is done by ``minibert.analysis`` and ``minibert.tools``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import InputError, require_extra
from ..logs import lines_to
from .common import (add_command, check_device, load, output_file, plot_file, read_lines, report_truncation,
                     tokenize)
from .settings import (FillCommand, InspectCommand, LayersCommand, MapCommand, ParityCommand, ProbeCommand,
                       ProbeOverTimeCommand)


# ------------------------------------------------------------------------------------------- layers
def add_layers(sub) -> None:
    add_command(sub, "layers", LayersCommand, cmd_layers,
                "per-layer table (norms, similarity) and a CKA heatmap for one text")


def cmd_layers(args) -> int:
    import torch

    from ..analysis import layers as L

    plot = plot_file(args.plot)
    model, tokenizer = load(args.model, dtype=args.dtype, max_length=args.max_length, device=args.device)
    truncated = []
    batch = {k: v.to(model.device) for k, v in tokenize(tokenizer, [args.text], args.max_length, truncated).items()}
    report_truncation(truncated, 1, args.max_length or tokenizer.model_max_length)
    with torch.inference_mode():
        out = model(**batch)
    mask = batch["attention_mask"]
    exclude = [tokenizer.vocab[tokenizer.cls_token], tokenizer.vocab[tokenizer.sep_token]] if args.exclude_special else []
    stats = L.layer_statistics(out.hidden_states, L.token_mask(mask, batch["input_ids"], exclude))
    cka = L.cka_matrix(out.hidden_states, mask, batch["input_ids"], exclude)
    tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0].tolist())
    print(f"{args.text!r} -> {len(tokens)} tokens: {' '.join(tokens)}")
    print(f"model {args.model}: hidden_states[0] = embeddings output, [1..{len(out.hidden_states) - 1}] = blocks"
          + ("; [CLS]/[SEP] excluded" if exclude else ""))
    print(f"{'layer':>5}  {'norm mean':>9}  {'norm std':>8}  {'cos prev':>8}  {'cos last':>8}  {'CKA last':>8}")
    for i in range(len(out.hidden_states)):
        prev = stats["cos_previous"][i]
        print(f"{i:>5}  {float(stats['norm_mean'][i]):>9.3f}  {float(stats['norm_std'][i]):>8.3f}  "
              f"{'-' if prev != prev else f'{float(prev):.3f}':>8}  {float(stats['cos_last'][i]):>8.3f}  "
              f"{float(cka[i, -1]):>8.3f}")
    if args.plot:
        from ..analysis.plots import similarity_heatmap

        text = args.text if len(args.text) <= 60 else args.text[:57].rstrip() + "..."
        path = similarity_heatmap(cka, plot, title=f"Linear CKA between layers: {text!r}")
        print(f"wrote {path}")
    return 0


# -------------------------------------------------------------------------------------------- probe
def add_probe(sub) -> None:
    add_command(sub, "probe", ProbeCommand, cmd_probe,
                "train a linear probe per layer on word labels from a CoNLL-U file")


def cmd_probe(args) -> int:
    from ..analysis.probing import probe_model
    from ..textfiles import read_conllu

    plot = plot_file(args.plot)
    check_device(args)
    data = read_conllu(args.data, column=args.column)
    model, tokenizer = load(args.model, dtype=args.dtype, device=args.device)
    result = probe_model(model, tokenizer, data, pool=args.word_pool, batch_size=args.batch_size, seed=args.seed,
                         progress=not args.quiet)
    print(f"probing {args.column} in {args.data} ({len(data)} sentences) with {args.model}, "
          f"word pool={args.word_pool}, "
          f"seed={args.seed}")
    print(result.table())
    if args.plot:
        from ..analysis.plots import probe_curve

        print(f"wrote {probe_curve(result, plot, title=f'Linear probe for {args.column}, per layer')}")
    return 0


# ---------------------------------------------------------------------------------- probe-over-time
def add_probe_over_time(sub) -> None:
    add_command(sub, "probe-over-time", ProbeOverTimeCommand, cmd_probe_over_time,
                "probe every layer of every snapshot of a pre-training run (minibert pretrain --snapshots N): "
                "when does each layer learn, which layers settle first")


def cmd_probe_over_time(args) -> int:
    from ..analysis.timeline import probe_over_time, save_timeline
    from ..textfiles import read_conllu

    plot = plot_file(args.plot)
    json_path = output_file(args.json, ".json", "--json") if args.json else None
    if not Path(args.run).is_dir():
        raise InputError(f"run folder not found: {Path(args.run).resolve()}")
    data = read_conllu(args.data, column=args.column)
    with lines_to(sys.stdout, enabled=not args.quiet):
        timeline = probe_over_time(args.run, data, pool=args.word_pool, batch_size=args.batch_size, seed=args.seed,
                                   device=check_device(args))
    print(f"probing {args.column} in {args.data} ({len(data)} sentences) across {len(timeline.steps)} snapshots "
          f"of {args.run}, word pool={args.word_pool}, seed={args.seed}")
    print(timeline.table())
    if json_path:
        print(f"wrote {save_timeline(timeline, json_path)}")
    if plot:
        from ..analysis.plots import timeline_heatmaps

        print(f"wrote {timeline_heatmaps(timeline, plot, title=f'Probing {args.column} across time: {args.run}')}")
    return 0


# ---------------------------------------------------------------------------------------------- map
def add_map(sub) -> None:
    add_command(sub, "map", MapCommand, cmd_map,
                "2-D maps of word, sentence or word-occurrence vectors, one panel per layer")


def cmd_map(args) -> int:
    from ..analysis import maps
    from ..analysis.layers import parse_layers

    plot = plot_file(args.out)
    json_path = output_file(args.json, ".json", "--json") if args.json else None
    if args.method not in maps.METHODS:
        raise InputError(f"--method {args.method!r}: use one of {maps.METHODS}")
    if args.method == "tsne":  # extras are checked before any work
        require_extra("sklearn", "t-SNE maps", "scikit-learn", "maps")
    elif args.method == "umap":
        require_extra("umap", "UMAP maps", "umap-learn")
    if args.max_points is not None and args.max_points < 3:
        raise InputError(f"--max-points must be >= 3, got {args.max_points}")
    check_device(args)
    suffix = Path(args.data).suffix.lower()
    words = [w for w in (args.word or "").split(",") if w.strip()]
    if suffix == ".conllu":
        if words:
            raise InputError("--word picks occurrences in a text table or text file; a .conllu map shows every "
                             "word, coloured by --column")
        from ..textfiles import read_conllu

        data = read_conllu(args.data, column=args.column)
    elif suffix in (".csv", ".tsv", ".jsonl"):
        from ..training.datasets import read_table

        table = read_table(args.data, text_column=args.text_column, label_column=args.label_column)
    elif suffix == ".txt":
        if not words:
            raise InputError(f"{args.data} is plain text: give --word W[,W2] (points are the occurrences of each "
                             "word, coloured by which word), or a labelled .csv/.tsv/.jsonl or .conllu file")
        texts = [t for t in read_lines(args.data) if t.strip()]
    else:
        raise InputError(f"{args.data}: use a .conllu, .csv, .tsv, .jsonl or .txt file (got {suffix or 'no suffix'!r})")
    model, tokenizer = load(args.model, dtype=args.dtype, device=args.device)
    parse_layers(args.layers, model.config.num_hidden_layers + 1)  # a bad --layers fails before any work
    progress = not args.quiet
    if suffix == ".conllu":
        points = maps.word_points(model, tokenizer, data, progress=progress)
    elif suffix == ".txt":
        points = maps.occurrence_points(model, tokenizer, texts, None, words=words, progress=progress)
    elif words:
        points = maps.occurrence_points(model, tokenizer, table.texts, table.labels, words=words, progress=progress)
    else:
        points = maps.sentence_points(model, tokenizer, table.texts, table.labels, method=args.pool, progress=progress)
    result = maps.stack_map(points, args.layers, method=args.method, seed=args.seed, max_points=args.max_points,
                            model=Path(str(args.model)).name or str(args.model))
    sampled = f" (a seeded sample of {len(result.labels)})" if len(result.labels) < len(points.labels) else ""
    print(f"{len(points.labels)} {points.what}{sampled}, {len(set(result.labels))} labels; {args.method} with seed "
          f"{args.seed}")
    print("layer  5-NN accuracy (leave-one-out, cosine, full space)")
    for layer, acc in zip(result.layers, result.knn_accuracy):
        print(f"{layer:>5}  {acc:.4f}")
    if json_path is not None:
        from ..textfiles import write_text_atomic

        write_text_atomic(json_path, json.dumps({"layers": result.layers, "labels": result.labels, "method": result.method,
                                                 "seed": result.seed, "knn_accuracy": result.knn_accuracy,
                                                 "coords": result.coords.round(5).tolist()}) + "\n")
        print(f"wrote {json_path}")
    print(f"wrote {maps.plot_stack_map(result, plot)}")
    return 0


# --------------------------------------------------------------------------------------------- fill
def add_fill(sub) -> None:
    add_command(sub, "fill", FillCommand, cmd_fill,
                "predict [MASK] tokens with the masked-LM head (and the logit lens)")


def cmd_fill(args) -> int:
    from ..analysis.lens import fill_mask, logit_lens

    plot = plot_file(args.plot)
    model, tokenizer = load(args.model, dtype=args.dtype, max_length=args.max_length, device=args.device)
    if args.top_k > model.config.vocab_size:
        raise InputError(f"--top-k {args.top_k} is larger than the vocabulary ({model.config.vocab_size} tokens)")
    if model.mlm_head is None:
        model.mlm_logits(None)  # raises the explanation
    predictions = fill_mask(model, tokenizer, args.texts, top_k=args.top_k, max_length=args.max_length)
    for text, masks in zip(args.texts, predictions):
        print(text)
        for k, top in enumerate(masks):
            print(f"  [MASK] #{k + 1}: " + ", ".join(f"{tok} {p:.3g}" for tok, p in top))
        if args.lens or args.plot:  # a plot is of the lens
            result = logit_lens(model, tokenizer, text, max_length=args.max_length)
            print(result.table())
            if plot:
                from ..analysis.plots import logit_lens as lens_plot

                print(f"wrote {lens_plot(result, plot)}")
    return 0


# ------------------------------------------------------------------------------------------- parity
def add_parity(sub) -> None:
    add_command(sub, "parity", ParityCommand, cmd_parity,
                "per-layer differences: minibert vs transformers, or two checkpoints")


def cmd_parity(args) -> int:
    from ..analysis.parity import run_parity

    device = check_device(args)  # --device with --dtype (int8 is the CPU's), before any work
    texts = None
    if args.texts:
        texts = [line for line in read_lines(args.texts) if line.strip()]
        if not texts:
            raise InputError(f"{args.texts} has no non-empty lines")
    json_path = output_file(args.json, ".json", "--json") if args.json else None
    if args.against is not None and _runtime_model(args.against):
        report = _runtime_parity(args, texts, device)
    else:
        if args.runtime != "auto":
            raise InputError(f"--runtime {args.runtime}: --against must then be a deployed model (an .onnx graph, an "
                             "OpenVINO .xml, a CTranslate2 folder)")
        if args.min_cosine is not None and args.dtype != "int8":
            raise InputError("--min-cosine judges a runtime's or int8's sentence vectors: give --against a deployed "
                             "model, or --dtype int8")
        report = run_parity(args.model, against=args.against, dtype=args.dtype or "fp32", texts=texts,
                            atol=args.atol, device=device)
        if args.min_cosine is not None:
            report.min_cosine = args.min_cosine  # int8's bound, as asked
    print(report.table())
    if json_path:
        report.write_json(json_path)
        print(f"wrote {json_path}")
    return 0 if report.ok else 1


def _runtime_model(against: str) -> bool:
    from ..compat.runtimes import is_runtime_model

    return is_runtime_model(against)


def _runtime_parity(args, texts, device):
    from ..compat.runtimes import runtime_parity

    if device is not None and str(device) != "cpu":
        raise InputError(f"--device {args.device}: a deployed model is compared on the CPU, where its runtime runs")
    if args.dtype not in (None, "fp32", "int8"):
        raise InputError(f"--dtype {args.dtype}: a runtime is judged as fp32 or int8")
    return runtime_parity(args.model, args.against, runtime=args.runtime, dtype=args.dtype, texts=texts,
                          atol=args.atol, min_cosine=args.min_cosine)


# ------------------------------------------------------------------------------------------ inspect
def add_inspect(sub) -> None:
    add_command(sub, "inspect", InspectCommand, cmd_inspect,
                "parameters per component, FLOPs per token, activation memory")


def cmd_inspect(args) -> int:
    from ..config import BertConfig
    from ..names import preset_name
    from ..tools.accounting import format_report

    lengths = list(args.lengths)  # positive integers: checked by the parser
    if not lengths:
        raise InputError("--lengths: give one or more sequence lengths, e.g. 128,512")
    if not Path(args.model).expanduser().exists() and preset_name(args.model):
        # official geometry: no download needed to count
        target, name = BertConfig.from_preset(args.model), f"{args.model} (built-in geometry, no weights loaded)"
    else:
        from ..models import BertModel

        target, name = BertModel.from_pretrained(args.model), args.model
    limit = (target if isinstance(target, BertConfig) else target.config).max_position_embeddings
    too_long = [T for T in lengths if T > limit]
    if too_long:
        raise InputError(f"--lengths {too_long} exceed max_position_embeddings={limit}")
    print(format_report(target, name, lengths=lengths, batch=args.batch_size))
    print(fast_path_routes(target if isinstance(target, BertConfig) else target.config))
    return 0


def fast_path_routes(config) -> str:
    """What the fast path runs for this geometry here, as lines for ``minibert inspect``: each fp32 product's
    route on this CPU (decided on the whole block: ``tools.plan.block_plan``, measured on first use and
    cached) beside its choice alone, the block's relative times, and the attention kernel (``tools.varlen``)
    on this CPU and on each GPU this machine has."""
    import torch

    from ..hardware import cpu_info
    from ..tools import kernels, plan as planning, varlen

    shapes = kernels.block_shapes(config.hidden_size, config.intermediate_size)
    forced = kernels.forced_route()
    how = (f"${kernels.OVERRIDE_ENV}" if forced else f"decided on whole blocks per row bucket, measured here, kept "
           f"in {kernels.cache_file()}")
    lines = [f"fast path fp32 routes on this CPU ({cpu_info()[0] or 'unknown'}, {torch.get_num_threads()} threads; "
             f"{how}):"]
    for bucket, timed_on in planning.BUCKETS.items():
        plan = planning.block_plan(config, bucket) if kernels.MKLDNN else dict.fromkeys(shapes, "linear")
        record = planning.plan_record(config, bucket) or {}
        rows = (f"at most {planning.SHORT_ROWS} real tokens" if bucket == "short" else
                f"more than {planning.SHORT_ROWS} real tokens")
        contexts = ", ".join(f"{B} x {T}" + (f" at {real:.0%} real" if real < 1 else "")
                             for B, T, real in timed_on["contexts"])
        lines.append(f"  {bucket} ({rows}; timed on {contexts}):")
        alone = record.get("per_product") or {}
        lines += [f"    {name:<17} {o} x {i}: {plan[name]}" + (f"  (alone: {alone[name]})" if name in alone else "")
                  for name, (o, i) in shapes.items()]
        if record.get("relative_time") and not forced:
            times = ", ".join(f"{name} {t:.3f}" for name, t in sorted(record["relative_time"].items(),
                                                                      key=lambda x: x[1]))
            lines.append(f"    whole block, time relative to F.linear for every product: {times} -> "
                         f"{record.get('chosen')}")
    d = config.head_size
    lines.append(f"attention: {varlen.attention_route('cpu', torch.float32, d)} on this CPU"
                 + (f" (${varlen.OVERRIDE_ENV})" if varlen.forced_route() else " (one call per sequence)"))
    for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        device = torch.device("cuda", index)
        chosen = {short: varlen.attention_route(device, dtype, d) for short, dtype in
                  (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))}
        lines.append(f"attention on {device} ({torch.cuda.get_device_name(device)}; measured, kept in "
                     f"{varlen.cache_file()}): " + ", ".join(f"{k} {v}" for k, v in chosen.items()))
    return "\n".join(lines)


COMMANDS = [add_layers, add_probe, add_probe_over_time, add_inspect, add_parity, add_fill, add_map]
