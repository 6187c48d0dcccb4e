# The plugin's own tests drive pytest in a temporary folder with `pytester`.
pytest_plugins = ["pytester"]
