"""`grpoflow deploy` and `grpoflow serve`: the pipeline as a scheduled Prefect deployment.

`add_parsers(subparsers)` adds both subcommands to the main CLI; `deploy_command(args)` /
`serve_command(args)` run them and raise `UserError` for user mistakes (the main CLI prints one line,
exit 2). `python -m cli.deploy deploy|serve ...` works on its own too.
"""
from __future__ import annotations

import argparse
import sys


def _common(sp: argparse.ArgumentParser, cron_default: str | None, cron_help: str) -> None:
    sp.add_argument("config", help="the YAML config each scheduled run starts from")
    sp.add_argument("--name", default=None, help="deployment name (default: <config name>-scheduled); "
                    "also the prefix of its run ids, <name>-<UTC timestamp>")
    sp.add_argument("--cron", default=cron_default, help=cron_help)
    sp.add_argument("--timezone", default=None, help="IANA timezone of --cron (default: UTC)")
    sp.add_argument("--run-prefix", default=None, help="run ids are <prefix>-<UTC timestamp> (default: --name)")
    sp.add_argument("--no-resume", dest="resume_unfinished", action="store_false",
                    help="always start a new run, even when the previous run of this deployment is unfinished")
    sp.add_argument("--on-overlap", choices=("enqueue", "cancel"), default="enqueue",
                    help="a run that fires while another is active waits for it (enqueue, default) or is "
                         "cancelled (cancel); two runs of one deployment never train at once")
    sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config value for every scheduled run (repeatable)")


def add_parsers(subparsers) -> None:
    from deployments.deploy import DEFAULT_CRON, DEFAULT_POOL
    d = subparsers.add_parser("deploy", help="register the pipeline as a scheduled deployment on a Prefect server")
    _common(d, DEFAULT_CRON, f"cron schedule (default: '{DEFAULT_CRON}', nightly); '' for no schedule")
    d.add_argument("--pool", default=DEFAULT_POOL, help=f"process work pool, created if missing (default: {DEFAULT_POOL})")
    d.add_argument("--api-url", default=None, help="Prefect API URL (default: PREFECT_API_URL)")
    d.add_argument("--workdir", default=None, help="directory the runs start in (default: the current one)")

    s = subparsers.add_parser("serve", help="serve the scheduled pipeline from this process (local use)")
    _common(s, None, "cron schedule (default: none; trigger with `prefect deployment run`)")


def deploy_command(args: argparse.Namespace) -> int:
    from deployments.deploy import deploy
    info = deploy(args.config, name=args.name, cron=args.cron or None, overrides=args.overrides,
                  work_pool=args.pool, api_url=args.api_url, timezone=args.timezone, run_prefix=args.run_prefix,
                  resume_unfinished=args.resume_unfinished, on_overlap=args.on_overlap, workdir=args.workdir)
    print(f"deployment {info['deployment']} registered at {info['api_url']} (id {info['deployment_id']})")
    when = f"cron '{info['cron']}' ({info['timezone'] or 'UTC'})" if info["cron"] else "no schedule"
    print(f"schedule:  {when}; overlapping runs: {info['on_overlap']}; "
          f"unfinished previous run: {'resumed' if args.resume_unfinished else 'left alone'}")
    print(f"runs:      {info['parameters']['run_prefix']}-<UTC timestamp>, started in {info['workdir']}")
    print(f"work pool: {info['work_pool']}{' (created)' if info['created_pool'] else ''}; start a worker with")
    print(f"  prefect worker start --pool {info['work_pool']}")
    print(f"run it now:  prefect deployment run '{info['deployment']}'")
    return 0


def serve_command(args: argparse.Namespace) -> int:
    from deployments.deploy import serve
    serve(args.config, name=args.name, cron=args.cron or None, overrides=args.overrides, timezone=args.timezone,
          run_prefix=args.run_prefix, resume_unfinished=args.resume_unfinished, on_overlap=args.on_overlap)
    return 0


def main(argv: list[str] | None = None) -> int:
    from runtime.errors import UserError
    p = argparse.ArgumentParser(prog="grpoflow")
    add_parsers(p.add_subparsers(dest="cmd", required=True))
    args = p.parse_args(argv)
    try:
        return deploy_command(args) if args.cmd == "deploy" else serve_command(args)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
