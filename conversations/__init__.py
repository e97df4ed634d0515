"""From chat conversations to the tokenized Parquet ``jobs.extract`` reads (the ``jobs.prepare`` command).

- ``config``: the command's config sections, each checking its own keys.
- ``reader``: conversation rows out of ``data.path`` (the files ``inputs.files`` finds), the schema
  (ShareGPT or OpenAI) detected per file or named, each row checked and normalised to messages.
- ``template``: the checkpoint's tokenizer and chat template; a conversation's ids and its exact
  assistant-only loss mask, from prefix renderings of the template (no string search).
- ``output``: the output directory: part files under temp names published together at the end, the
  side record ``_prepare.json``, the skipped rows, resume and refusal rules.
- ``tokenize``: a shard's conversations into its part, with the row accounting; in worker processes for
  large inputs.
- ``pipeline``: the run: inputs checked, the streaming passes over shards, the side record.
- ``regenerate``: the target answers the prompts again through SGLang, in a Ray actor; resumable
  per shard.
- ``demo``: a chat tokenizer trained locally for the demo's tiny model, and conversations for it.

Nothing here imports SGLang: ``extractor.generator`` does, inside the regeneration actor only.
Nothing here imports ``jobs``: its commands (``jobs.prepare``, ``jobs.pipeline``) import this package, and what
both share sits below both, in ``runtime`` (exit codes, signals, the Ray session, the display, output.dir's lock)
and ``inputs`` (the files behind ``data.path``, the demos' models).
"""
