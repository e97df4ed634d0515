"""What every layer shares: the checks config sections run on their own keys, the ``output.dir`` every command's
``output`` section extends (``common.config``), sizes read and written as people
write them (``parse_bytes``, ``format_bytes``), and the PYTHONPATH of a command the project starts
(``checkout_first``). Imports nothing of the project."""
