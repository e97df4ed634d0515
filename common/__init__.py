"""What every layer shares: the checks config sections run on their own keys. Imports nothing of the project."""
