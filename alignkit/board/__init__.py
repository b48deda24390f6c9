"""`alignkit board`: a local web page to launch, watch, compare, stop and chat with runs.

- `runs.py`: what is known about runs, read from their folders (status, progress, ETA, curves, metrics,
  predictions); no web framework, tested without a browser.
- `launch.py`: starting (`alignkit train` with a config checked by `config.parse.read_config`), stopping
  (the stop file `StopOnRequest` honours) and resuming runs.
- `app.py`: the Gradio page over those two (needs the `board` extra).
"""
