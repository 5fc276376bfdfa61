"""The `sweeper` command and its subcommands: parsing (`cli`), exit codes (`exits`), `sweeper run`
(`run_client`), `sweeper demo`, `sweeper local` and `sweeper openapi`.
"""
