# kvsp's services in one image: `docker build -t kvsp:0.1.0 .`, then run any `kvsp` command
# (deploy/kubernetes runs `kvsp index serve`, `kvsp holder serve`, ...). The install is the
# README's own: `make setup`, the target `make demo` and `make test` start with (virtual
# environment, torch 2.13.0, the model), so the image and a developer's machine cannot differ.
FROM python:3.11-slim-bookworm

# what the Makefile itself needs to run; `make setup` installs the rest (gcc and the Python
# headers for the compiled modules, redis-server and curl)
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/kvsp
COPY pyproject.toml setup.py Makefile README.md ./
COPY src ./src
ENV KVSP_HOME=/opt/kvsp/home
RUN make setup VENV=/opt/kvsp/.venv && rm -rf /root/.cache/pip

RUN useradd --system --home-dir /opt/kvsp kvsp && chown -R kvsp /opt/kvsp/home
USER kvsp
ENV PATH=/opt/kvsp/.venv/bin:$PATH
EXPOSE 8080
ENTRYPOINT ["kvsp"]
CMD ["--help"]
