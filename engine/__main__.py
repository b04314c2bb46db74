"""``python -m engine {preprocess,convert,train,eval,serve,plan} [--spec spec.json] [--run-dir DIR] [MindSpeed flags]``."""

from engine.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
