"""`python -m jax_rope info` and `python -m jax_rope demo`."""

import argparse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_rope")
    parser.add_argument("command", choices=["info", "demo", "masks"], help="what to run")
    args = parser.parse_args(argv)
    if args.command == "info":
        from jax_rope import describe

        print(describe())
        return 0
    if args.command == "masks":
        from jax_rope.attention import mask_pictures

        print(mask_pictures.render(), end="")
        return 0
    from jax_rope import demo

    return demo.main()


if __name__ == "__main__":
    raise SystemExit(main())
