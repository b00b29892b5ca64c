"""The weight sync from the policy into the engines: the method (``sync``), the senders, the process group, IPC."""
