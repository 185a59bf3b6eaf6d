"""`bulkinfer run`: every option of a run, as flags."""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import typer

from bulkinfer.cli.app import Command, app, epilog
from bulkinfer.cli.options import (
    BatchOrderOption,
    BucketsOption,
    ChatTemplateKwargsOption,
    ChatTemplateOption,
    ChoiceOption,
    ConfigOption,
    DataParallelSizeOption,
    DtypeOption,
    EnforceEagerOption,
    EngineArgOption,
    FrequencyPenaltyOption,
    GpuMemoryUtilizationOption,
    HugePagesAtStartOption,
    IgnoreEosOption,
    JsonSchemaOption,
    KvCacheMemoryBytesOption,
    LogitBiasOption,
    LogprobsOption,
    MaxInFlightOption,
    MaxModelLenOption,
    MaxNumBatchedTokensOption,
    MaxNumSeqsOption,
    MaxTokensOption,
    MaxWaitOption,
    MetricsTextfileOption,
    MinPOption,
    MinTokensOption,
    ModelOption,
    NoEnforceEagerOption,
    NoHugePagesAtStartOption,
    NoPassthroughOption,
    NoPrefixAwareOption,
    NOption,
    OrderOption,
    OutputOrderOption,
    OverwriteOption,
    PaddingBatchSizeOption,
    PassthroughOption,
    PlainProgressOption,
    PrefixAwareOption,
    PresencePenaltyOption,
    PriorityOption,
    QuantizationOption,
    RawPromptsOption,
    RayCpusPerReplicaOption,
    RayMaxRestartsOption,
    RayOption,
    RegexOption,
    RepetitionPenaltyOption,
    ResumeOption,
    RunInputArgument,
    RunOutputOption,
    SeedOption,
    SpeculativeTailOption,
    StallTimeoutOption,
    StartTimeoutOption,
    StopOption,
    StopTokenIdsOption,
    StreamErrorsOption,
    TemperatureOption,
    TensorParallelSizeOption,
    TopKOption,
    TopPOption,
    TopPSamplerOption,
    TrustRemoteCodeOption,
    VerboseOption,
    WindowRowsOption,
)
from bulkinfer.cli.signals import invoke

if TYPE_CHECKING:
    from bulkinfer.jobs.run import RunReport

EXAMPLES = (
    "bulkinfer run prompts.jsonl",
    "bulkinfer run prompts.parquet -o answers.parquet --max-tokens 128",
    "bulkinfer run batch.jsonl --model ./my-model -tp 2 --temperature 0",
    "bulkinfer run prompts.jsonl --config configs/default.toml",
    "bulkinfer run prompts.jsonl --resume",
    "bulkinfer run reviews.jsonl --choice positive,negative,neutral --temperature 0",
    "bulkinfer run texts.jsonl --json-schema person.schema.json",
    "tail -f requests.jsonl | bulkinfer run - --max-wait 0.5 > answers.jsonl",
)


@app.command(cls=Command, epilog=epilog(EXAMPLES))
def run(
    input_path: RunInputArgument,
    output: RunOutputOption = None,
    errors: StreamErrorsOption = None,
    config: ConfigOption = None,
    model: ModelOption = None,
    apply_chat_template: ChatTemplateOption = None,
    raw_prompts: RawPromptsOption = False,
    chat_template_kwargs: ChatTemplateKwargsOption = None,
    passthrough: PassthroughOption = None,
    no_passthrough: NoPassthroughOption = False,
    overwrite: OverwriteOption = False,
    resume: ResumeOption = False,
    plain_progress: PlainProgressOption = False,
    verbose: VerboseOption = False,
    metrics_textfile: MetricsTextfileOption = None,
    max_tokens: MaxTokensOption = None,
    temperature: TemperatureOption = None,
    top_p: TopPOption = None,
    stop: StopOption = None,
    ignore_eos: IgnoreEosOption = None,
    n: NOption = None,
    logprobs: LogprobsOption = None,
    top_k: TopKOption = None,
    min_p: MinPOption = None,
    presence_penalty: PresencePenaltyOption = None,
    frequency_penalty: FrequencyPenaltyOption = None,
    repetition_penalty: RepetitionPenaltyOption = None,
    min_tokens: MinTokensOption = None,
    stop_token_ids: StopTokenIdsOption = None,
    logit_bias: LogitBiasOption = None,
    priority: PriorityOption = None,
    json_schema: JsonSchemaOption = None,
    choice: ChoiceOption = None,
    regex: RegexOption = None,
    dtype: DtypeOption = None,
    tensor_parallel_size: TensorParallelSizeOption = None,
    data_parallel_size: DataParallelSizeOption = None,
    ray: RayOption = None,
    ray_cpus_per_replica: RayCpusPerReplicaOption = None,
    ray_max_restarts: RayMaxRestartsOption = None,
    quantization: QuantizationOption = None,
    max_model_len: MaxModelLenOption = None,
    max_num_seqs: MaxNumSeqsOption = None,
    max_num_batched_tokens: MaxNumBatchedTokensOption = None,
    gpu_memory_utilization: GpuMemoryUtilizationOption = None,
    kv_cache_memory_bytes: KvCacheMemoryBytesOption = None,
    enforce_eager: EnforceEagerOption = None,
    no_enforce_eager: NoEnforceEagerOption = False,
    seed: SeedOption = None,
    trust_remote_code: TrustRemoteCodeOption = None,
    top_p_sampler: TopPSamplerOption = None,
    batch_order: BatchOrderOption = None,
    speculative_tail: SpeculativeTailOption = None,
    huge_pages_at_start: HugePagesAtStartOption = None,
    no_huge_pages_at_start: NoHugePagesAtStartOption = False,
    engine_arg: EngineArgOption = None,
    order: OrderOption = None,
    prefix_aware: PrefixAwareOption = None,
    no_prefix_aware: NoPrefixAwareOption = False,
    buckets: BucketsOption = None,
    window_rows: WindowRowsOption = None,
    max_wait_s: MaxWaitOption = None,
    max_in_flight: MaxInFlightOption = None,
    padding_batch_size: PaddingBatchSizeOption = None,
    stall_timeout_s: StallTimeoutOption = None,
    start_timeout_s: StartTimeoutOption = None,
    output_order: OutputOrderOption = None,
) -> None:
    """Generate a completion for every row of INPUT; write OUT, OUT.errors.jsonl and OUT.report.json."""
    import bulkinfer

    result = invoke(dict(locals()), bulkinfer.run, input_path, output, errors_path=errors)
    if str(input_path) == "-":  # the stream printed its line on standard error: standard output is data
        raise typer.Exit(code=result.exit_code)
    summarize(result)


def summarize(result: RunReport) -> NoReturn:
    """Print the run's summary (or that its output was already complete) and
    exit with the run's exit code (``run`` and ``embed``)."""
    from rich.console import Console

    from bulkinfer.report.terminal import print_summary

    if result.report.get("already_complete"):
        typer.echo(f"bulkinfer: {result.output} is already complete; nothing to do")
    else:
        print_summary(result.report, Console())
    raise typer.Exit(code=result.exit_code)
