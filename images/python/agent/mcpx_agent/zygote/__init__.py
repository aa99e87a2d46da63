"""The zygote: loads the libraries once (the preload bundle, huge pages) and forks every worker."""
