"""Several gateway processes on one machine: one port, one instance table, one load account.

`supervisor` starts and restarts the workers; `shared_table` is the memory they share;
`shared_rows` and `shared_registry` are the account rows and the instance registry over it;
`worker` is one worker's main; `whole_metrics` answers /metrics for all of them.
"""
