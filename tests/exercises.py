"""The workshop's exercises: for each lesson, the functions at its heart that a participant writes.

tests/workshop.py blanks them in a copy of the course and grades them with their proofs. An exercise
names one function or method, or two that are one idea, by qualified name in its lesson; the lessons
keep those names. Its `task` states the rules a body must keep; tests/test_workshop.py plants, for
each rule a wrong body can break, a body that breaks that rule only, and a proof must fail on it.

The proofs are not picked: they are every test of the lesson's own test file that runs the
exercise's code, as the suite recorded it (tests/ran.py, which tests/proofs.py keeps true). A test
of another file that runs it too (test_09 trains with 02's ZeRO) is no proof: it needs later
lessons' exercises as well, and would make a check take minutes. No proof takes over 30 s in a
check (the slowest, test_09's test_any_mesh_equals_one_device, 23 s on two busy cores), so none is
left out for its time. `needs`: the other exercises whose code the proofs run; a lesson's tests mix
its exercises (02.1's proofs run 02.3's code and 02.3's run 02.1's), so some need each other: they
are solved together, or their blank is met first.
"""
from __future__ import annotations

from dataclasses import dataclass

from ran import RAN


@dataclass(frozen=True)
class Exercise:
    id: str                      # "02.1": lesson 02, exercise 1
    file: str                    # the lesson
    names: tuple[str, ...]       # qualified names of the functions whose bodies are blanked
    title: str                   # what the raise says: no quotes, backslashes or parentheses
    task: str                    # what the code must do, what it may call, where the lesson explains it
    hint: str
    minutes: int                 # estimated time for a participant who has read the lesson

    @property
    def test_file(self) -> str:
        return f"test_{self.file}"

    @property
    def node_ids(self) -> tuple[str, ...]:
        """The proofs, as node ids relative to tests/: the tests of its lesson's file that run it."""
        return tuple(test for test, ran in RAN.items()
                     if self.id in ran and test.startswith(f"{self.test_file}::"))

    @property
    def proofs(self) -> tuple[str, ...]:
        """The proofs, as names within the test file."""
        return tuple(test.split("::", 1)[1] for test in self.node_ids)

    @property
    def needs(self) -> tuple[str, ...]:
        return tuple(sorted({i for test in self.node_ids for i in RAN[test]} - {self.id}))


EXERCISES = (
    Exercise(
        "01.1", "01_ddp.py", ("all_reduce_gradients",), "naive data parallelism",
        task="After backward, leave in every trainable parameter's .grad the mean of the group's gradients: "
             "one blocking all_reduce (01's wrapper, which meters it) per parameter, then a division by "
             "the group's size. Frozen parameters (requires_grad=False) are skipped; a trainable one "
             "without a gradient raises RuntimeError('<name> got no gradient: unused parameters are not "
             "supported'). Docstring: THE IDEA, THREE VERSIONS (a).",
        hint="The sum of N rank-mean gradients / N is the gradient of the global batch's mean loss; "
             "dist.get_world_size(group) is N.",
        minutes=10),
    Exercise(
        "01.2", "01_ddp.py", ("BucketedDataParallel._on_grad_ready", "GradBucket.unpack"),
        "bucketed all-reduce, launched from the gradient hook",
        task="_on_grad_ready runs as each gradient is complete: outside no_sync(), copy it into its bucket "
             "(GradBucket.add), then launch 01's all_reduce over self.group, async (async_op=True, its "
             "work in bucket.work), of every full bucket from self.next_to_launch on, in order, stopping "
             "at the first that is not full; keep self.max_in_flight, the most launched and unfinished "
             "at once. unpack: wait for the bucket's all-reduce, divide by the group's size (world), "
             "copy each view back into its parameter's .grad, empty `ready` and forget the work. "
             "Docstring: THREE VERSIONS (b).",
        hint="A bucket is full when len(bucket.ready) == len(bucket.params). Collectives are matched by "
             "call order: a later bucket that fills first must wait for the earlier ones.",
        minutes=20),

    Exercise(
        "02.1", "02_zero.py", ("ZeRO._on_grad_ready", "ZeRO._reduce"),
        "ZeRO: reduce each unit from the backward hook",
        task="_on_grad_ready(index, i, param) runs when parameter i of unit self.units[index] has its "
             "gradient: raise RuntimeError('a second backward before step() ...') if the unit's reduction "
             "is still pending (unit.reduction); with fp32 gradients (unit.grad_views is not None) add "
             "param.grad into unit.grad_views[i] and drop it (param.grad = None); once all of the unit's "
             "parameters are ready, clear unit.ready, release the unit's parameters in stage 3, and reduce "
             "it unless under no_sync(). _reduce(unit), async, keeping (work, its input) in unit.reduction: "
             "stage 0 all-reduces unit.flat_grad in place (it is also grad_shard); stage 1 reduce-scatters "
             "flat_grad into a new grad_shard of flat_grad's dtype; stages 2-3 first "
             "self._release_send_buffer() (one send buffer at a time), flatten the gradients "
             "(unit.flatten, in self.dtype), free them (p.grad = None), reduce-scatter that into "
             "unit.grad_shard and set self.sending = unit. Docstring: THE IDEA, COST, FP32 GRADIENTS.",
        hint="finish_gradient_sync waits on unit.reduction[0] and divides by the group size: the hook only "
             "launches. The send buffer must outlive the call until the wait.",
        minutes=20),
    Exercise(
        "02.2", "02_zero.py", ("ZeRO.grad_squares",), "the global gradient norm from shards",
        task="Return ||g||^2 of the averaged gradient over the whole group, as an fp32 scalar: each unit's "
             "grad_shard holds this rank's slice unit.owned of the unit's flat vector (padding included); "
             "weigh each parameter's elements by share(p), sum their squares in fp32, then (stages 1-3, "
             "where each rank has a part) all_reduce the scalar. Docstring: GRADIENT CLIPPING.",
        hint="Parameter j of a unit covers [unit.offsets[j], unit.offsets[j + 1]) of the flat vector; "
             "intersect that with unit.owned and shift by unit.owned.start. Clipping each shard by its "
             "own norm is the classic bug.",
        minutes=20),
    Exercise(
        "02.3", "02_zero.py", ("ZeRO._gather", "ZeRO._after_forward", "ZeRO._gather_for_backward"),
        "ZeRO-3: gather before use, free after, prefetch the next",
        task="_gather(index, next_index), a module's forward pre-hook (and, in backward, a hook on its "
             "output's gradient): count a gather that was already in flight in self.prefetched_gathers, "
             "launch unit index's all-gather if none is (_launch_gather), wait for it, bind the gathered "
             "vector to the parameters (unit.bind), and, with self.prefetch, launch next_index's gather "
             "if that unit exists. _after_forward(index, output): release the unit's parameters, and if "
             "output requires grad, register on it foundation.weak_hook(self._gather_for_backward, index), "
             "a hook that holds the ZeRO weakly (weak_hook says why); _gather_for_backward(index, grad) "
             "gathers them again for backward, prefetching index - 1. Docstring: THE IDEA (stage 3), COST "
             "(1.5x DDP).",
        hint="A unit still gathered from an earlier use has gather_work None: nothing to wait for. "
             "Backward visits the units in reverse: its next one is index - 1.",
        minutes=25),

    Exercise(
        "03.1", "03_tensor_parallel.py", ("conjugate.Conjugate.forward", "conjugate.Conjugate.backward"),
        "the conjugate f/g operators as one autograd function",
        task="conjugate(forward, backward) builds the four operators f, g and SP's pair: the autograd "
             "function applies forward(x, group) to the input and backward(grad, group) to the gradient. "
             "forward keeps the group in ctx; backward returns the gradient of x and None for the group. "
             "Docstring: THE CONJUGATE OPERATORS, SEQUENCE PARALLELISM.",
        hint="f = (identity, all-reduce): every rank uses the same input, so its gradient is the sum of "
             "the ranks' gradients; g = (all-reduce, identity) is its mirror.",
        minutes=10),
    Exercise(
        "03.2", "03_tensor_parallel.py", ("VocabParallelCrossEntropy.forward",),
        "vocab-parallel cross-entropy without the full logits",
        task="Mean cross-entropy from this rank's columns [first_id, first_id + V/t) of the logits: "
             "compute in at least fp32 (ctx.dtype = the input's), padding ids (>= vocab_size) are -inf; "
             "three all-reduces of one number per row (_all_reduced): the row max (\"max\"), the sum of "
             "exp(logit - max), the target's shifted logit (only the rank holding the target contributes "
             "it; the others 0, never -inf x 0). Save for backward (softmax, local targets clamped to 0 "
             "where not held, held mask) and return mean(log sum - target). Docstring: VOCAB PARALLELISM.",
        hint="loss = log sum_v e^(z_v - m) - (z_target - m); backward is given and reads exactly "
             "ctx.saved_tensors = (exp / sum_exp[:, None], local_target, mine).",
        minutes=20),
    Exercise(
        "03.3", "03_tensor_parallel.py", ("enter_region", "exit_region"),
        "f before a region, g after it",
        task="enter_region registers a forward pre-hook that passes the module's first argument through f "
             "(CopyToRegion; with sequence parallelism GatherSequence) and leaves the others; exit_region "
             "a forward hook that passes the output through g (ReduceFromRegion; with SP "
             "ReduceScatterSequence). At tp = 1 nothing is registered, nor by enter_region where the module's "
             "linears gather their input themselves (keeps_sequence_shard(module, ctx)). Both return the module. "
             "Docstring: THE CONJUGATE OPERATORS, SEQUENCE PARALLELISM.",
        hint="A forward pre-hook returning a tuple replaces the arguments; a forward hook returning a "
             "tensor replaces the output. The operators take (x, ctx.group).",
        minutes=10),

    Exercise(
        "04.1", "04_pipeline.py", ("compute_order",), "the order of forwards and backwards on a rank",
        task="Return rank's compute actions for schedule \"gpipe\", \"1f1b\", \"zb-h1\" or \"interleaved\": "
             "warm-up forwards, then one forward and one backward at a time (GPipe: every forward first); "
             "ZB-H1 adds each microbatch's W, rank r postponing its first r to the end; interleaved runs "
             "its v stages (rank, rank + pp, ...) on microbatches in groups of pp, backward through the "
             "chunks in reverse. Actions: Action(kind, stage, microbatch). Docstring: SCHEDULES ARE DATA.",
        hint="1F1B's warm-up on rank r is min(m, pp - r - 1) forwards. Interleaved: total m v actions of "
             "each kind, warm-up min(m v, 2 (pp - r - 1) + (v - 1) pp).",
        minutes=35),
    Exercise(
        "04.2", "04_pipeline.py", ("bubble_formula",), "the bubble of each schedule",
        task="The idle fraction of a step, with unit times F = 1, B = 2 (ZB-H1: F = B = W = 1), for each "
             "schedule: the share of the step a rank spends waiting, the same on every rank. GPipe and 1F1B "
             "share theirs; interleaved divides the warm-up by v; ZB-H1 fills the tail with W's, and for "
             "m < p the last rank's F, B, F, B chain sets the length. Docstring: SCHEDULES ARE DATA.",
        hint="Draw p = 2, m = 3 by hand (str(make_schedule('1f1b', 2, 3)) draws it): the step lasts "
             "m + p - 1 forward-backward slots. ZB-H1 for m >= p: (p - 1) / (3m + p - 1).",
        minutes=15),

    Exercise(
        "05.1", "05_context_parallel.py", ("merge_partials",), "merging two partial attentions by lse",
        task="Attention over the keys of A and B from (out_a, lse_a) and (out_b, lse_b): "
             "weights sigmoid(lse_a - lse_b) and its complement, lse = lse_a - logsigmoid(lse_a - lse_b). "
             "A block with lse = -inf had no key: the result is the other block's, and no -inf - -inf may "
             "appear, even in backward. Cast the weight to out_a's dtype. Docstring: THE MERGE RULE.",
        hint="torch.where(empty_a | empty_b, 0.0, lse_a - lse_b) keeps the difference finite; the "
             "weight broadcasts over the head dimension with [..., None].",
        minutes=15),
    Exercise(
        "05.2", "05_context_parallel.py",
        ("SequenceLayout.chunks", "SequenceLayout.shard", "SequenceLayout.unshard"), "the zigzag layout",
        task="chunks(rank): the chunk indices rank holds, (r,) contiguous, (r, 2P-1-r) zigzag; shard(x, "
             "rank, dim): those chunks of x along dim, concatenated in that order; unshard(shards, dim): "
             "the whole sequence back from every rank's shard. Docstring: LOAD BALANCE.",
        hint="x.narrow(dim, c * self.chunk_len, self.chunk_len) is chunk c.",
        minutes=10),
    Exercise(
        "05.3", "05_context_parallel.py", ("RingAttention.forward",), "the forward of ring attention",
        task="Attention of this rank's queries over the whole sequence: for each K/V block the ring "
             "delivers (_kv_ring: owner, stacked k and v), compute each pair of chunks _block_pairs yields "
             "with block.forward (through `compute`, which times it when `work` is given) and merge it "
             "into a running fp32 out and float64 lse (-inf at first) with merge_into. Save q, k, v, "
             "out, lse and ctx.args = (group, layout, causal, block, compute) for the given backward, "
             "set_materialize_grads(False); return out in q's dtype and the lse in fp32. "
             "Docstring: RING ATTENTION.",
        hint="The block call: compute(block.forward, q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], "
             "q_off, k_off, masked).",
        minutes=25),

    Exercise(
        "06.1", "06_expert_parallel.py", ("dispatch", "combine"), "dispatch and combine over all-to-all",
        task="dispatch(x, plan): the rows of the kept assignments (plan.kept_slots // plan.top_k), "
             "exchanged over the group (exchange: rows plan.send_splits[j] go to rank j, "
             "plan.recv_splits[j] arrive from it), then regrouped by local expert (plan.by_expert). "
             "combine(y, plan, n_tokens): the reverse: undo the regrouping, exchange back, and place "
             "each row in its (token, slot) of a zero (n_tokens, top_k, dim) tensor. "
             "Docstring: EXPERT PARALLELISM.",
        hint="The inverse of a permutation p is torch.argsort(p); exchange's backward is the reverse "
             "all-to-all, so autograd needs nothing more.",
        minutes=20),
    Exercise(
        "06.2", "06_expert_parallel.py", ("sync_gradients",), "gradients of an expert-parallel model",
        task="After backward, make every gradient the global mean loss's: replicated weights all-reduce "
             "over the group and divide by ep; experts, already summed over the group's tokens by the "
             "backward all-to-all, only divide by ep. Skip frozen parameters; a trainable one without a "
             "gradient raises RuntimeError('<name> got no gradient'). Docstring: EXPERT PARALLELISM.",
        hint="moe_layers(model) and layer.expert_parameters() find the experts. All-reducing an expert "
             "too, or forgetting / ep, doubles its gradient at ep = 2.",
        minutes=10),

    Exercise(
        "07.1", "07_flash_attention.py", ("_key_range", "_query_range"), "which blocks a program visits",
        task="_key_range: for the query block at start_m, keys [0, full_end) are visible to every row (no "
             "mask), [full_end, hi) need one, the rest are skipped. _query_range: for the key block at "
             "start_n, queries [0, lo) see none of its keys, [lo, full_start) need a mask, [full_start, "
             "q_end) see all. Causal visibility with absolute positions: row + shift >= col. "
             "Docstring: CAUSAL.",
        hint="Without the causal mask only the sequence's end needs a mask. Round to block multiples "
             "with // BLOCK * BLOCK and tl.cdiv, clamp with tl.minimum / tl.maximum.",
        minutes=25),
    Exercise(
        "07.2", "07_flash_attention.py", ("_attend",), "the online-softmax recurrence",
        task="For the key blocks [start, end), BLOCK_N at a time: load K (_tile, _load_keys), scores "
             "s = q k^T x qk_scale (log2 units), masked to -inf where not _visible if MASKED, then the "
             "recurrence: m_new = max(m, rowmax s), alpha = exp2(m - m_new), p = exp2(s - m_new), "
             "l = alpha l + rowsum p, acc = alpha acc + p V. Return (acc, l, m). Docstring: THE "
             "RECURRENCE, PRECISION.",
        hint="A row that has seen no key has m = -inf: subtract 0 instead of -inf (masked blocks only), "
             "else exp2 meets -inf - -inf. Dots: tl.dot(..., input_precision=PRECISION); p.to(v.dtype).",
        minutes=30),

    Exercise(
        "08.1", "08_fp8.py", ("amax_to_scale",), "the scale rule",
        task="s = fp8_max(dtype) / amax in fp32, finite and positive for every finite amax, zero included "
             "(clamp the amax at AMAX_EPS). Docstring: THE SCALE RULE.",
        hint="A tensor of amaxes gives a tensor of scales: torch.full_like(amax, fp8_max(dtype)) / amax.",
        minutes=5),
    Exercise(
        "08.2", "08_fp8.py", ("cast_to_fp8",), "the saturating cast",
        task="x * scale (in fp32) cast to dtype, saturating: a finite value beyond +-fp8_max clips to it "
             "(also one whose product overflows fp32 to inf); NaN stays NaN; an infinite input stays "
             "+-inf in e5m2 and becomes NaN in e4m3fn, which has no inf (INF_BITS, NAN_BITS). "
             "Docstring: THE FORMATS, SATURATION.",
        hint="torch's own cast saturates e4m3fn's inf to 448 and overflows e5m2: clamp first, then put "
             "the infinite inputs back with torch.where.",
        minutes=15),
    Exercise(
        "08.3", "08_fp8.py", ("DelayedScaling.scale", "DelayedScaling.quantize"), "delayed scaling",
        task="scale(first_amax): the (1, 1) scale of the next quantize: from the max of the amax history "
             "once there is one, else from first_amax (None: None), divided by 2^margin; guard: 1 while "
             "that amax is 0 or not finite. quantize(x): refuse an empty or 0-d x (ValueError), move the "
             "history to x's device, quantize with that scale through fused_amax_cast (the first call "
             "uses x's own amax), push the new amax at the front of the history, count the call; "
             "return (q shaped like x, scale). Docstring: SCALING RECIPES (delayed).",
        hint="fused_amax_cast(rows, dtype=..., scale=...) returns (q, scale, amax); rows are x reshaped "
             "to (-1, x.shape[-1]). Newest first: torch.cat([amax.view(1), history[:-1]]).",
        minutes=20),

    Exercise(
        "09.1", "09_full_train.py", ("MeshSizes.coords", "MeshSizes.rank"), "the rank map",
        task="coords(rank) -> {dim: index} for the dims of DIMS (dp, pp, cp, tp), tp varying fastest; "
             "rank(**coords) its inverse: rank = ((d pp + p) cp + c) tp + t. Docstring: THE MESH.",
        hint="divmod by the sizes from the fastest dimension (reversed(DIMS)) to the slowest.",
        minutes=10),
    Exercise(
        "09.2", "09_full_train.py", ("MeshSizes.groups",), "the process groups of a mesh",
        task="Every group of ranks that differ only along `dims` (a tuple of dims): one per combination "
             "of the other dims' indices, in mesh order, each group's ranks in mesh order. Use rank(). "
             "Docstring: THE MESH.",
        hint="itertools.product over the fixed dims' ranges, and inside over the moving dims' ranges.",
        minutes=15),
    Exercise(
        "09.3", "09_full_train.py", ("inside_node",), "whether a group stays inside a node",
        task="Return whether every group of this kind (its dims: GROUP_DIMS, dp x cp for a "
             "kind not there) has all its ranks on one node of gpus_per_node consecutive ranks. Ranks "
             "are numbered tp fastest (09's MeshSizes.rank), so only the group's dims of size > 1 move, "
             "and a group lies in an aligned block of its slowest moving dim's size x the sizes of all "
             "faster dims. Docstring: THE STEP TIME; inside_node's own.",
        hint="Draw dp = 1, pp = 1, cp = 2, tp = 2 on nodes of 2: the cp groups are 0, 2 and 1, 3. "
             "A block no bigger than a node can still straddle two: each block must lie in one node. "
             "Blocks and nodes realign every lcm of their sizes, and 6 GPUs of one node of 8 are "
             "inside it: only the job's ranks count.",
        minutes=10),
    Exercise(
        "09.4", "09_full_train.py", ("pipeline_span",), "the span of the pipeline",
        task="Return (span, fill): fill, the sends nothing hides, boundary seconds each: with overlap "
             "(hide) the first forward's pp - 1 boundary crossings and the last backward's, without it "
             "every microbatch's both ways over the pp x virtual - 1 boundaries, none at pp = 1; span, "
             "the slowest rank's busy seconds stretched so that 04's bubble is its idle fraction, plus "
             "fill. Docstring: THE STEP TIME; pipeline_span's own.",
        hint="A rank idle a fraction b of a span T is busy (1 - b) T. Compare 1F1B at pp = 8, m = 8 "
             "(bubble 7/15): dividing by 1 - b and multiplying by 1 + b differ by 1.9x.",
        minutes=10),
)
