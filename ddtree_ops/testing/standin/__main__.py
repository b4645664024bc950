"""`python -m ddtree_ops.testing.standin [SGLang launch flags]`: what the sandbox units run."""

from .timeline import main

if __name__ == "__main__":
    main()
