"""What every layer shares: the checks config sections run on their own keys, and sizes read and written as
people write them (``parse_bytes``, ``format_bytes``). Imports nothing of the project."""
