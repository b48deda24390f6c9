"""The board's web page (Gradio): runs, one run, compare, launch and stop, chat.

Every view is recomputed from the run folders on each refresh (`runs.py` reads them; nothing here parses
files), so the page shows runs started from the command line as well as its own. A timer refreshes the
lists and the selected run every `REFRESH_SECONDS` while the page is open.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator, Optional

from ..data.multimodal import IMAGE_PLACEHOLDER
from ..errors import ConfigError
from ..train import RUN_CONFIG_FILE
from . import launch as launching
from . import runs as reading

logger = logging.getLogger(__name__)

REFRESH_SECONDS = 2.0
RUN_COLUMNS = ["run", "stage", "model", "dataset", "status", "progress", "ETA", "loss", "reward", "accuracy", "updated"]
CHAT_MODELS_KEPT = 2  # loaded chat models kept in memory (the run's and its base)
CHAT_IMAGE = "the chat's image"  # how the chat's errors name an image given on the page
CHECKOUT_EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _number(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.4g}"


def _short(text: str, width: int = 40) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


class Board:
    """The state behind the page: the runs folder, the processes it started, the chat models it loaded.

    Args:
        runs_root: the folder whose runs the board shows; nothing outside it is read or written.
        workdir: the folder runs are started from (relative paths in configs are relative to it).
    """

    def __init__(self, runs_root: str | os.PathLike, workdir: str | os.PathLike | None = None) -> None:
        self.root = Path(runs_root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.workdir = Path(workdir or os.getcwd()).resolve()
        self.launches: dict[Path, launching.Launch] = {}
        self.chat_models: OrderedDict[tuple, Any] = OrderedDict()
        self.chat_processors: dict[tuple, Any] = {}  # (model, adapters) -> its `ImageProcessing`, once images came
        self.chat_lock = threading.Lock()
        self.examples = launching.example_configs(self.workdir / "examples", CHECKOUT_EXAMPLES)

    # ----- reading -----------------------------------------------------------------------------------

    def reap(self) -> None:
        """Collect the exit status of finished child runs (so none lingers as a zombie that looks alive)."""
        for item in self.launches.values():
            item.process.poll()

    def summaries(self) -> list[reading.RunSummary]:
        self.reap()
        return reading.list_runs(self.root)

    def run_dir(self, name: Optional[str]) -> Path:
        if not name:
            raise reading.BoardError("choose a run first.")
        path = reading.resolve_inside(self.root, name)
        if not reading.is_run_dir(path):
            raise reading.BoardError(f"{name} is not a run folder under {self.root}.")
        return path

    def runs_table(self, summaries: list[reading.RunSummary]):
        import pandas as pd

        rows = []
        for s in summaries:
            progress = f"{s.step}/{s.total_steps}" if s.total_steps else str(s.step or "")
            if s.progress is not None:
                progress += f" ({100 * s.progress:.0f}%)"
            status = s.status + (" (stop requested)" if s.status == "running" and s.stop_requested else "")
            rows.append([s.name, s.stage, _short(s.model), s.dataset, status, progress,
                         reading.format_duration(s.eta_seconds), _number(s.loss), _number(s.reward),
                         _number(s.accuracy), time.strftime("%H:%M:%S", time.localtime(s.updated)) if s.updated else ""])
        return pd.DataFrame(rows, columns=RUN_COLUMNS)

    def run_view(self, name: Optional[str]) -> dict[str, Any]:
        """Everything the run page shows for one run."""
        import pandas as pd

        path = self.run_dir(name)
        summary = reading.summarize_run(self.root, path)
        records = reading.read_records(path)
        series = reading.curves(records)
        loss_keys = [k for k in ("loss", "eval_loss") if k in series]
        stage_keys = reading.stage_metric_keys(summary.stage, list(series))
        status = f"**{summary.name}**: {summary.status}"
        if summary.stop_requested and summary.status == "running":
            status += " (stop requested: ends after this step, with a checkpoint)"
        if summary.total_steps:
            status += f" · step {summary.step} of {summary.total_steps}"
        if summary.eta_seconds is not None:
            status += f" · ETA {reading.format_duration(summary.eta_seconds)}"
        status += f" · stage {summary.stage} · model `{summary.model}` · dataset `{summary.dataset}`"
        checkpoints = reading.checkpoints_of(path)
        if checkpoints:
            status += f" · checkpoints at steps {', '.join(map(str, checkpoints))}"
        metrics = reading.final_metrics(path)
        table_name, rows = reading.table_rows(path)
        config_file = reading.run_file(path, RUN_CONFIG_FILE)
        console = reading.run_file(path, launching.CONSOLE_FILE)
        return {
            "summary": summary,
            "status": status,
            "loss": _frame(series, loss_keys),
            "lr": _frame(series, ["learning_rate"] if "learning_rate" in series else []),
            "stage": _frame(series, stage_keys),
            "metrics": pd.DataFrame(sorted(metrics.items()), columns=["metric", "value"]) if metrics
            else pd.DataFrame(columns=["metric", "value"]),
            "config": config_file.read_text(encoding="utf-8") if config_file.is_file() else "",
            "table_name": f"`{table_name}`: last {len(rows)} rows" if table_name else "No predictions or completions yet.",
            "table": pd.DataFrame(rows) if rows else pd.DataFrame(),
            "console": _tail(console) if console.is_file() else "",
        }

    def compare_view(self, names: list[str], metric: Optional[str]):
        """The chosen metric of several runs on one chart, and their final metrics side by side."""
        import pandas as pd

        metric = metric or "loss"
        frames, columns, available = [], {}, set()
        for name in names or []:
            path = self.run_dir(name)
            series = reading.curves(reading.read_records(path))
            available |= set(series)
            for step, value in series.get(metric, []):
                frames.append({"step": step, "value": value, "run": name})
            final = reading.final_metrics(path)
            summary = reading.summarize_run(self.root, path)
            final.setdefault("status", summary.status)
            final.setdefault("steps", summary.step)
            columns[name] = final
        keys = sorted({k for values in columns.values() for k in values})
        table = pd.DataFrame([[k] + [_cell(columns[n].get(k)) for n in columns] for k in keys],
                             columns=["metric"] + list(columns))
        plot = pd.DataFrame(frames) if frames else _empty_plot("run")
        return plot, table, sorted(available)

    def signature(self, names: list[str]) -> tuple:
        """What changes when any of these runs writes something (its status and its files' times and sizes)."""
        parts = []
        for name in names:
            try:
                path = self.run_dir(name)
                status = reading.run_status(path)
            except reading.BoardError:
                parts.append((name, None))
                continue
            stats = []
            for file in sorted(path.iterdir()):
                try:
                    info = file.lstat()  # a link's own times: what it points to is read through run_file only
                except OSError:
                    continue
                stats.append((file.name, info.st_mtime_ns, info.st_size))
            parts.append((name, status, tuple(stats)))
        return tuple(parts)

    # ----- launch / stop / resume ----------------------------------------------------------------------

    def start(self, yaml_text: str, overrides_text: str) -> str:
        overrides = launching.split_overrides(overrides_text)
        config_file, output_dir = launching.check_launch(self.root, yaml_text, overrides, self.workdir)
        item = launching.start_run(config_file, overrides, output_dir, self.workdir)
        self.launches[output_dir] = item
        return f"Started **{reading.run_name(self.root, output_dir)}** ({item.describe()})."

    def check(self, yaml_text: str, overrides_text: str) -> str:
        overrides = launching.split_overrides(overrides_text)
        config_file, output_dir = launching.check_launch(self.root, yaml_text, overrides, self.workdir)
        config_file.unlink(missing_ok=True)
        return f"The config is valid; the run will write to **{reading.run_name(self.root, output_dir)}**."

    def stop(self, name: str) -> str:
        path = launching.stop_run(self.run_dir(name))
        return f"Stop requested ({path.name} written): the run ends after its current step, with a checkpoint."

    def resume(self, name: str) -> str:
        item = launching.resume_run(self.root, self.run_dir(name))
        self.launches[item.output_dir] = item
        return f"Resumed **{name}** ({item.describe()})."

    # ----- chat ----------------------------------------------------------------------------------------

    def chat_model(self, model: str, adapters: Optional[str], template: Optional[str]):
        """A chat model and formatter, loaded once and kept (the last `CHAT_MODELS_KEPT`)."""
        from ..chat import load_chat_model
        from ..config.parse import parse_config

        key = (model, adapters, template)
        with self.chat_lock:
            if key in self.chat_models:
                self.chat_models.move_to_end(key)
                return self.chat_models[key]
            values = {"model_name_or_path": model, "adapter_name_or_path": adapters}
            loaded = load_chat_model(parse_config(values).model, template)
            self.chat_models[key] = loaded
            while len(self.chat_models) > CHAT_MODELS_KEPT:
                self.chat_models.popitem(last=False)
            return loaded

    def chat_pair(self, name: str) -> tuple[tuple, tuple]:
        """(model, adapters, template) of the run's model (its adapter on its base) and of that base."""
        path = self.run_dir(name)
        reading.check_run_folder(path)  # the model loader reads the folder's files itself
        values, workdir = reading.read_run_config(path)
        if not values:
            raise reading.BoardError(f"{name} has no run_config.yaml, so its base model is unknown; chat with it "
                                     "from the command line (alignkit chat --model BASE --adapter DIR).")
        adapter = reading.run_file(path, "adapter_config.json")
        if not (adapter.is_file() or reading.run_file(path, "config.json").is_file()):
            raise reading.BoardError(f"{name} has no saved model yet (it is written when the run ends or stops).")
        base = str(values.get("model_name_or_path") or "smollm2-135m-instruct")
        start = values.get("adapter_name_or_path")

        def absolute(text: str) -> str:
            candidate = Path(workdir or self.workdir) / text
            return str(candidate) if not Path(text).is_absolute() and candidate.exists() else text

        base = absolute(base)
        start = ",".join(absolute(a.strip()) for a in str(start).split(",")) if start else None
        template = values.get("template")
        if adapter.is_file():
            return (base, str(path), template), (base, start, template)
        return (str(path), None, template), (base, start, template)

    def chat_tools(self, name: str, given: str = "", environment: str = "") -> Optional[dict[str, Any]]:
        """The tools the chat with run `name` may call: `given` (comma-separated `file.py:function` /
        `module:function`) or else the run's `tools` key; the environment class `environment` (`file.py:Class`) or
        else the run's `environment_factory` key; with the run's `max_tool_calling_iterations`, `tool_timeout` and
        `max_tool_output_chars` (GRPO's defaults where unset). None when neither names a tool or an environment.

        A relative file is looked up as the run looked it up: from its config file's folder, then the folder it ran
        in (`run_config.yaml`'s `# source:` and `# cwd:` lines), then the board's working folder. The environment
        comes back as its class (`environment_factory`, None without): each conversation gets an instance of its
        own (`start_chat_environment`).

        Raises:
            ConfigError: a tool or an environment that does not load (the message names it).
        """
        from ..evaluate import TOOL_KEYS, tool_arguments
        from ..rl.tools import load_environment_factory, load_tools

        path = self.run_dir(name)
        values, workdir = reading.read_run_config(path)
        specs = given.strip() or values.get("tools") or []
        if isinstance(specs, str):
            specs = [t.strip() for t in specs.split(",") if t.strip()]
        factory_spec = environment.strip() or values.get("environment_factory") or None
        if not specs and not factory_spec:
            return None
        source = reading.run_config_source(path)
        folders = [Path(workdir or self.workdir)]
        if source:
            folders.insert(0, (folders[0] / source).parent)
        args = tool_arguments([_resolve_tool(spec, folders) for spec in specs],
                              {key: values[key] for key in TOOL_KEYS if key in values},
                              _resolve_tool(factory_spec, folders) if factory_spec else None)
        functions = load_tools(args.tools)
        factory = (load_environment_factory(args.environment_factory, tools=functions, key="environment_factory")
                   if args.environment_factory else None)
        return {"functions": functions, "environment_factory": factory,
                "max_iterations": args.max_tool_calling_iterations, "tool_timeout": args.tool_timeout,
                "max_tool_output_chars": args.max_tool_output_chars}

    @staticmethod
    def start_chat_environment(tools: dict[str, Any], messages: list[dict[str, Any]]) -> tuple[Any, str]:
        """A new conversation's environment (`tools["environment_factory"]()`), reset at its first message as
        `alignkit chat --environment-factory` resets it (`chat.start_environment`); returns the instance and the
        first message's text with the observation `reset` returned appended."""
        from ..chat import start_environment

        instance = tools["environment_factory"]()
        content, _ = start_environment(instance, messages)
        return instance, content

    @staticmethod
    def with_environment(tools: dict[str, Any], instance: Any) -> dict[str, Any]:
        """`tools` with the public methods of the conversation's environment `instance` added as tools (bound to it:
        its state is the conversation's)."""
        from ..rl.tools import environment_methods

        return {**tools, "functions": list(tools["functions"]) + environment_methods(instance)}

    def tool_reply(self, key: tuple, messages: list[dict[str, Any]], max_new_tokens: int,
                   tools: dict[str, Any]) -> list[dict[str, Any]]:
        """The reply of the model `key` when it may call `tools` (`chat_tools`): GRPO's tool loop
        (`chat.tool_turns`), greedy, each turn at most `max_new_tokens`, as chat bubbles (`tool_bubbles`)."""
        from ..chat import tool_turns
        from ..config import GeneratingArguments

        model, formatter = self.chat_model(*key)
        reply = tool_turns(model, formatter, messages, GeneratingArguments(max_new_tokens=int(max_new_tokens)),
                           tools["functions"], max_iterations=tools["max_iterations"],
                           tool_timeout=tools["tool_timeout"], max_tool_output_chars=tools["max_tool_output_chars"])
        return tool_bubbles(reply)

    def chat_images(self, key: tuple, image_paths: list[str]):
        """The processor the model `key` reads `image_paths` with (`chat.chat_images`, as `alignkit chat --image`;
        None without images), read before the weights load.

        Raises:
            ConfigError: a text-only model, or a file that is not an image (the message says which).
        """
        from ..chat import chat_images, check_images
        from ..config.parse import parse_config

        if not image_paths:
            return None
        model, adapters, _ = key
        if (model, adapters) not in self.chat_processors:
            model_args = parse_config({"model_name_or_path": model, "adapter_name_or_path": adapters}).model
            self.chat_processors[(model, adapters)] = chat_images(model_args, image_paths, source=CHAT_IMAGE)
        check_images(image_paths, CHAT_IMAGE)
        return self.chat_processors[(model, adapters)]

    def reply(self, key: tuple, messages: list[dict[str, str]], max_new_tokens: int,
              image_paths: Optional[list[str]] = None) -> Iterator[str]:
        """The reply of the model `key`, piece by piece, through `alignkit chat`'s own path (`chat.reply_pieces`),
        with the conversation's images (in the order of its `<image>` placeholders) for a vision-language model."""
        from ..chat import reply_pieces
        from ..config import GeneratingArguments

        images = self.chat_images(key, image_paths or [])
        model, formatter = self.chat_model(*key)
        yield from reply_pieces(model, formatter, messages, GeneratingArguments(max_new_tokens=int(max_new_tokens)),
                                images, image_paths or ())


def _frame(series: dict[str, list[tuple[int, float]]], keys: list[str]):
    import pandas as pd

    rows = [{"step": step, "value": value, "series": key} for key in keys for step, value in series.get(key, [])]
    return pd.DataFrame(rows) if rows else _empty_plot("series")


def _plot(gr, frame, color: str, title: str, elem_id: str, height: int = 260):
    """A line plot of `frame` (columns step, value and `color`), one line per value of `color`."""
    return gr.LinePlot(value=frame, x="step", y="value", color=color, title=title, elem_id=elem_id, height=height)


def _empty_plot(color: str):
    """A plot's data with no points but the right column types: the page keeps the types of the first data
    it got, and an empty float `series` column makes the legend a number scale (drawn as -Infinity, no lines)."""
    import pandas as pd

    return pd.DataFrame({"step": pd.Series(dtype="int64"), "value": pd.Series(dtype="float64"),
                         color: pd.Series(dtype="object")})


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value)


def _tail(path: Path, limit: int = 6000) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(size - limit, 0))
        return f.read().decode("utf-8", errors="replace")


def _message(err: Exception) -> str:
    return f"**Error:** {err}"


def build_app(board: Board):
    """The Gradio Blocks of the board (not launched)."""
    import gradio as gr

    def names() -> list[str]:
        return [s.name for s in board.summaries()]

    with gr.Blocks(title="alignkit board") as app:
        gr.Markdown(f"# alignkit board\nRuns under `{board.root}` · runs start from `{board.workdir}`")
        timer = gr.Timer(REFRESH_SECONDS)
        # The plots are drawn anew (gr.render) whenever what they show changes: a line plot keeps the series it
        # was first drawn with (Gradio 6 fixes its colour domain then), so a curve or a run added by a later
        # update would not be drawn. These states name what is drawn; the timer changes them.
        run_plot_key = gr.State(None)
        compare_plot_key = gr.State(None)
        # Every tab is rendered from the start (render_children): a tab first opened after the timer has updated its
        # components would otherwise mount with their initial choices and miss those updates.
        # Dropdowns start empty (value=None): Gradio would otherwise preselect the first choice, and choosing
        # it again would not count as a change.
        with gr.Tabs():
            with gr.Tab("Runs", id="runs", render_children=True):
                runs_table = gr.Dataframe(value=board.runs_table(board.summaries()), interactive=False,
                                          elem_id="runs-table", label="Runs (refreshed every few seconds)")
            with gr.Tab("Run", id="run", render_children=True):
                run_pick = gr.Dropdown(choices=names(), value=None, label="Run", elem_id="run-pick")
                run_status = gr.Markdown(elem_id="run-status")
                with gr.Row():
                    stop_button = gr.Button("Stop (checkpoint, resumable)", elem_id="stop-button", variant="stop")
                    resume_button = gr.Button("Resume", elem_id="resume-button")
                run_action = gr.Markdown(elem_id="run-action")

                @gr.render(inputs=run_plot_key, triggers=[run_plot_key.change])
                def draw_run(key):
                    if not key:
                        return
                    try:
                        view = board.run_view(key[0])
                    except reading.BoardError as err:
                        gr.Markdown(_message(err))
                        return
                    with gr.Row():
                        _plot(gr, view["loss"], "series", "Loss", "loss-plot")
                        _plot(gr, view["lr"], "series", "Learning rate", "lr-plot")
                    _plot(gr, view["stage"], "series", f"Stage metrics ({view['summary'].stage})", "stage-plot")

                metrics_table = gr.Dataframe(label="Final metrics", interactive=False, elem_id="final-metrics")
                table_title = gr.Markdown(elem_id="table-title")
                predictions = gr.Dataframe(label="Predictions / completions", interactive=False,
                                           elem_id="predictions", max_height=300)
                with gr.Accordion("Config it ran with (run_config.yaml)", open=False):
                    config_view = gr.Code(language="yaml", interactive=False, elem_id="run-config")
                with gr.Accordion("Console (runs started from the board)", open=False):
                    console_view = gr.Textbox(lines=10, max_lines=20, interactive=False, show_label=False,
                                              elem_id="run-console")
            with gr.Tab("Compare", id="compare", render_children=True):
                compare_pick = gr.Dropdown(choices=names(), value=[], multiselect=True, label="Runs", elem_id="compare-pick")
                metric_pick = gr.Dropdown(choices=["loss"], value="loss", label="Metric", allow_custom_value=True,
                                          elem_id="metric-pick")

                @gr.render(inputs=compare_plot_key, triggers=[compare_plot_key.change])
                def draw_compare(key):
                    if not key or not key[0]:
                        return
                    try:
                        plot, _, _ = board.compare_view(list(key[0]), key[1])
                    except reading.BoardError as err:
                        gr.Markdown(_message(err))
                        return
                    _plot(gr, plot, "run", f"{key[1]} of {', '.join(key[0])}", "compare-plot", height=320)

                compare_table = gr.Dataframe(label="Final metrics side by side", interactive=False,
                                             elem_id="compare-table")
            with gr.Tab("Launch", id="launch", render_children=True):
                example_pick = gr.Dropdown(choices=list(board.examples), value=None, label="Example config", elem_id="example-pick")
                yaml_box = gr.Textbox(label="Config (YAML, editable)", lines=16, max_lines=40, elem_id="yaml-box")
                overrides_box = gr.Textbox(label="Overrides: key=value, one per line or space-separated", lines=2,
                                           elem_id="overrides-box")
                with gr.Row():
                    check_button = gr.Button("Check", elem_id="check-button")
                    start_button = gr.Button("Start", variant="primary", elem_id="start-button")
                launch_message = gr.Markdown(elem_id="launch-message")
            with gr.Tab("Chat", id="chat", render_children=True):
                chat_pick = gr.Dropdown(choices=names(), value=None, label="Run (its adapter on its base, beside that base)",
                                        elem_id="chat-pick")
                max_new_tokens = gr.Slider(8, 512, value=64, step=8, label="max_new_tokens")
                with gr.Row():
                    run_bot = gr.Chatbot(label="the run's model", elem_id="run-bot", height=320)
                    base_bot = gr.Chatbot(label="its base", elem_id="base-bot", height=320)
                with gr.Row():
                    tools_box = gr.Textbox(label="Tools the models may call (file.py:function, comma-separated; "
                                           "empty: the run's `tools` key, if any)", elem_id="chat-tools", scale=2)
                    environment_box = gr.Textbox(label="Environment (file.py:Class, TRL's reset/step contract; empty: "
                                                 "the run's `environment_factory`, if any)",
                                                 elem_id="chat-environment", scale=1)
                # Each model's environment instance for the conversation on the page (one per browser session).
                environments_state = gr.State({})
                with gr.Row():
                    message_box = gr.Textbox(label="Message", elem_id="chat-message", scale=3)
                    # The uploaded file as it is (image_mode=None: not re-encoded), read by the model's own processor.
                    image_box = gr.Image(type="filepath", image_mode=None, sources=["upload", "clipboard"],
                                         label="Image for the message (a vision-language run)", elem_id="chat-image",
                                         height=120, scale=1)
                with gr.Row():
                    send_button = gr.Button("Send", variant="primary", elem_id="chat-send")
                    clear_button = gr.Button("Clear", elem_id="chat-clear")
                chat_message = gr.Markdown(elem_id="chat-error")

        run_outputs = [run_status, metrics_table, table_title, predictions, config_view, console_view, stop_button,
                       resume_button, run_plot_key]

        def show_run(name):
            if not name:
                return [gr.skip()] * len(run_outputs)
            try:
                view = board.run_view(name)
            except reading.BoardError as err:
                return [_message(err)] + [gr.skip()] * (len(run_outputs) - 1)
            status = view["summary"].status
            return [view["status"], view["metrics"], view["table_name"],
                    gr.update(value=view["table"], visible=not view["table"].empty), view["config"], view["console"],
                    gr.update(interactive=status == "running"), gr.update(interactive=status in ("stopped", "failed")),
                    (name, board.signature([name]))]

        def show_compare(selected, metric):
            try:
                _, table, available = board.compare_view(selected or [], metric)
            except reading.BoardError:
                return gr.skip(), gr.skip(), gr.skip()
            choices = sorted(set(available) | {metric or "loss"})
            key = (tuple(selected or []), metric or "loss", board.signature(selected or []))
            return key, table, gr.update(choices=choices)

        def refresh(run_name, selected, metric, shown):
            # Only what changed is sent: every update re-lays the page out, and each plot redraws itself on a
            # layout change, so updates on every tick would keep the plots blank half of the time.
            summaries = board.summaries()
            names = [s.name for s in summaries]
            table = board.runs_table(summaries)
            table_sig = tuple(map(tuple, table.drop(columns=["updated"]).values.tolist()))
            run_sig = board.signature([run_name] if run_name else [])
            compare_sig = (board.signature(selected or []), metric)
            choices = gr.update(choices=names) if names != shown[0] else gr.skip()
            run_part = show_run(run_name) if run_sig != shown[1] else [gr.skip()] * len(run_outputs)
            compare = (show_compare(selected, metric) if selected and compare_sig != shown[2]
                       else (gr.skip(), gr.skip(), gr.skip()))
            return [table if table_sig != shown[3] else gr.skip(), choices, choices, choices, *run_part, *compare,
                    (names, run_sig, compare_sig, table_sig)]

        shown = gr.State((None, None, None, None))
        timer.tick(refresh, inputs=[run_pick, compare_pick, metric_pick, shown],
                   outputs=[runs_table, run_pick, compare_pick, chat_pick, *run_outputs, compare_plot_key,
                            compare_table, metric_pick, shown], show_progress="hidden")
        run_pick.change(show_run, inputs=run_pick, outputs=run_outputs, show_progress="hidden")
        compare_pick.change(show_compare, inputs=[compare_pick, metric_pick],
                            outputs=[compare_plot_key, compare_table, metric_pick], show_progress="hidden")
        metric_pick.change(show_compare, inputs=[compare_pick, metric_pick],
                           outputs=[compare_plot_key, compare_table, metric_pick], show_progress="hidden")

        def act(action, *args):
            try:
                return action(*args)
            except (ConfigError, reading.BoardError, OSError) as err:
                return _message(err)

        stop_button.click(lambda name: act(board.stop, name), inputs=run_pick, outputs=run_action)
        resume_button.click(lambda name: act(board.resume, name), inputs=run_pick, outputs=run_action)

        def load_example(name):
            path = board.examples.get(name)
            return path.read_text(encoding="utf-8") if path else gr.skip()

        example_pick.change(load_example, inputs=example_pick, outputs=yaml_box)
        check_button.click(lambda y, o: act(board.check, y, o), inputs=[yaml_box, overrides_box], outputs=launch_message)
        start_button.click(lambda y, o: act(board.start, y, o), inputs=[yaml_box, overrides_box],
                           outputs=launch_message)

        def respond(name, text, run_history, base_history, tokens, tools_text, image=None, environment_text="",
                    environments=None):
            """The page's chat: each model's reply to `text`; with tools, the whole tool loop. With an environment
            each model's conversation has an instance of its own in `environments` (the session's state), made and
            reset at the conversation's first message and kept until Clear."""
            run_history, base_history = list(run_history or []), list(base_history or [])
            environments = dict(environments or {})
            if not text or not text.strip():
                yield run_history, base_history, gr.skip(), "Type a message first.", gr.skip(), environments
                return
            # The image goes with this message and stays in the conversation (shown in its bubble) until Clear.
            turn = [{"path": image}, text] if image else text
            try:
                run_key, base_key = board.chat_pair(name)
                tools = board.chat_tools(name, tools_text or "", environment_text or "")
                _, image_paths = chat_conversation(run_history + [{"role": "user", "content": turn}])
                if image_paths and tools is not None:
                    raise ConfigError("images and tools together are not supported in the chat yet (the tool loop "
                                      "generates from text only); clear the chat and use one of them.")
                for key in (run_key, base_key):  # a text-only model is refused before any weights load
                    board.chat_images(key, image_paths)
            except (reading.BoardError, ConfigError) as err:
                yield run_history, base_history, gr.skip(), _message(err), gr.skip(), environments
                return
            for side, history, key in (("run", run_history, run_key), ("base", base_history, base_key)):
                history.append({"role": "user", "content": turn})
                messages, image_paths = chat_conversation(history)
                if tools is not None:  # the whole tool loop, then its turns as bubbles
                    try:
                        if tools["environment_factory"] is not None:
                            if side not in environments:  # a new conversation: its environment, reset
                                environments[side], content = board.start_chat_environment(tools, messages)
                                messages[-1]["content"] = history[-1]["content"] = content
                            history += board.tool_reply(key, messages, tokens,
                                                        board.with_environment(tools, environments[side]))
                        else:
                            history += board.tool_reply(key, messages, tokens, tools)
                    except Exception as err:  # a model that fails to load or generate: say so on the page
                        logger.exception("chat with %s failed", key)
                        history.append({"role": "assistant", "content": f"(error: {type(err).__name__}: {err})"})
                    yield run_history, base_history, "", "", None, environments
                    continue
                history.append({"role": "assistant", "content": ""})
                reply = ""
                try:
                    for piece in board.reply(key, messages, tokens, image_paths):
                        reply += piece
                        history[-1]["content"] = _shown(reply)
                        yield run_history, base_history, "", "", None, environments
                except Exception as err:  # a model that fails to load or generate: say so on the page
                    logger.exception("chat with %s failed", key)
                    reply = f"(error: {type(err).__name__}: {err})"
                history[-1]["content"] = _shown(reply)
                yield run_history, base_history, "", "", None, environments

        chat_inputs = [chat_pick, message_box, run_bot, base_bot, max_new_tokens, tools_box, image_box,
                       environment_box, environments_state]
        chat_outputs = [run_bot, base_bot, message_box, chat_message, image_box, environments_state]
        send_button.click(respond, inputs=chat_inputs, outputs=chat_outputs)
        message_box.submit(respond, inputs=chat_inputs, outputs=chat_outputs)
        clear_button.click(lambda: ([], [], "", None, {}),
                           outputs=[run_bot, base_bot, chat_message, image_box, environments_state])
    return app


def _resolve_tool(spec: str, folders: list[Path]) -> str:
    """`file.py:function` with the file made absolute from the first folder that holds it (unchanged when none does,
    or for `module:function`, so the loader's own message names what is missing)."""
    file, _, function = spec.rpartition(":")
    if not file.endswith(".py") or Path(file).is_absolute():
        return spec
    for folder in folders:
        if (folder / file).is_file():
            return f"{folder / file}:{function}"
    return spec


# The title a tool call or result bubble carries (Gradio shows such a message as a box of its own); the chat leaves
# these out of the history it sends back to the model.
TOOL_BUBBLE_TITLES = {"call": "tool call", "result": "tool result"}


def tool_bubbles(reply: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A tool reply (`chat.tool_turns`) as assistant chat bubbles, in order: each call and each result a bubble titled
    `TOOL_BUBBLE_TITLES`, the model's text plain. Example: a call to add, its result, then "It is 5." -> bubbles
    `-> add({"a": 2, "b": 3})` (tool call), `[add] 5` (tool result), `It is 5.`"""
    from ..chat import tool_turn_lines

    bubbles = []
    for kind, line in tool_turn_lines(reply):
        bubble: dict[str, Any] = {"role": "assistant", "content": line}
        if kind in TOOL_BUBBLE_TITLES:
            bubble["metadata"] = {"title": TOOL_BUBBLE_TITLES[kind]}
        bubbles.append(bubble)
    return bubbles or [{"role": "assistant", "content": _shown("")}]


def is_tool_bubble(message: dict[str, Any]) -> bool:
    """Whether a chat message is a tool call or result bubble (`tool_bubbles`), not a turn of the conversation."""
    return (message.get("metadata") or {}).get("title") in TOOL_BUBBLE_TITLES.values()


def _shown(reply: str) -> str:
    """A reply as the chat shows it: one of only whitespace (or nothing) would be an empty bubble, so say so.

    Example: "\\n\\n" -> "(the model replied with whitespace only: 2 characters)".
    """
    if reply.strip():
        return reply
    return f"(the model replied with whitespace only: {len(reply)} characters)" if reply else "(no reply yet)"


def _text(content: Any) -> str:
    """A chat message's text (Gradio may hand back structured content); its files count for nothing."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text(part) for part in content)
    if isinstance(content, dict):
        return str(content.get("text", ""))
    return str(content)


def _files(content: Any) -> list[str]:
    """The paths of a chat message's files, in order: `{"path": ...}` as the page sends them, or Gradio's
    `{"type": "file", "file": {"path": ...}}` as it hands them back."""
    parts = content if isinstance(content, list) else [content]
    paths = []
    for part in parts:
        if isinstance(part, dict) and part.get("path"):
            paths.append(str(part["path"]))
        elif isinstance(part, dict) and isinstance(part.get("file"), dict) and part["file"].get("path"):
            paths.append(str(part["file"]["path"]))
    return paths


def chat_conversation(history: list[dict[str, Any]]) -> tuple[list[dict[str, str]], list[str]]:
    """The chat's history as the messages sent to a model, and the images they hold in the order of their `<image>`
    placeholders. Tool bubbles are left out; a turn's images (its file parts) go before its text as placeholders
    unless the text places them itself (`chat.with_images`, as `alignkit chat --image` does).

    Example: `[{"role": "user", "content": [{"path": "cat.png"}, "What is it?"]}]` ->
    `([{"role": "user", "content": "<image>What is it?"}], ["cat.png"])`.

    Raises:
        ConfigError: a turn whose text holds `<image>` placeholders, but not one per image.
    """
    from ..chat import with_images

    messages, images = [], []
    for message in history:
        if is_tool_bubble(message):
            continue
        text, files = _text(message["content"]), _files(message["content"])
        if files:
            text = with_images(text, len(files))
            images += files
        messages.append({"role": message["role"], "content": text})
    held = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
    if images and held != len(images):
        raise ConfigError(f"the conversation holds {held - len(images)} {IMAGE_PLACEHOLDER} text(s) besides its "
                          f"images; a vision-language model reads that text as an image's place: clear the chat and "
                          f"leave it out.")
    return messages, images


def serve(runs: str, host: str = "127.0.0.1", port: Optional[int] = None, workdir: Optional[str] = None,
          block: bool = True):
    """Build the board over `runs` and serve it on `host:port` (Gradio's default port range when None)."""
    import gradio as gr

    board = Board(runs, workdir)
    app = build_app(board)
    app.queue(default_concurrency_limit=4)
    theme = gr.themes.Default()
    print(f"alignkit board: runs under {board.root}, on http://{host}:{port or 7860}", flush=True)
    app.launch(server_name=host, server_port=port, prevent_thread_lock=not block, share=False, show_error=True,
               inbrowser=False, theme=theme, quiet=False, ssr_mode=False)
    return app, board


__all__ = ["Board", "build_app", "serve", "tool_bubbles", "is_tool_bubble", "chat_conversation"]
