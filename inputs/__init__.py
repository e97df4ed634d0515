"""What the commands read: the files behind ``data.path`` (``files``), the tokenized dataset the job checks
(``dataset``), the ``data`` and ``demo`` sections (``config``) and the demos' tiny models, data and chat
(``demo``, ``demo_chat``). Below both the extraction job (``jobs``) and the conversations pipeline
(``conversations``): imports nothing of either."""
