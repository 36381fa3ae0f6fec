"""`python -m jax_rope info` and `python -m jax_rope demo`."""

import argparse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_rope")
    parser.add_argument("command", choices=["info", "demo"], help="what to run")
    args = parser.parse_args(argv)
    if args.command == "info":
        from jax_rope import describe

        print(describe())
        return 0
    from jax_rope import demo

    return demo.main()


if __name__ == "__main__":
    raise SystemExit(main())
