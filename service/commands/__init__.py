"""The `sweeper` command: what each subcommand does, parsed, run and ended with one exit code.

    cli                 the console script: parse, run the command, failures to exit codes
    parser              the command line: one small function per subcommand, plugin commands
    exits               exit codes; one line per problem or warning on stderr
    startup             settings and policies loaded and checked, the database, the heap
    processes           serve, worker, migrate: the service's own processes
    check_config        check-config: every problem at once, and the database reached
    rotate_credentials  credentials rotate-key: stored credentials under the current key
    verify_evidence     evidence verify: an export checked offline
    run_client          run: trigger a run on a server, follow its progress
    local/              local: the service with a ready configuration, its simulated store
    demo                demo: the whole pipeline on a few thousand items
    openapi             openapi: the OpenAPI document written or checked
"""
