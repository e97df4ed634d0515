"""What a command runs on, shared by the extraction job (``jobs``) and the conversations pipeline (``conversations``):
how a command ends (``errors``: exit codes, the stops that carry them, ``ConfigError``), what a signal does
(``interrupts``), which Ray cluster it joins (``cluster``: the ``ray`` section and the session), what it shows while
it works (``display``) and ``output.dir``'s lock (``lock``). Imports of the project only ``common``."""
