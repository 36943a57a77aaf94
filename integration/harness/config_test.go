package harness

import (
	"strings"
	"testing"
)

func TestConfigRendering(t *testing.T) {
	c := layout("x", "/tmp/lfh-x")
	cfg := c.config()
	for _, want := range []string{"version = 3", "imports = []", `"io.containerd.grpc.v1.cri"`,
		`socket_dir = "/tmp/lfh-x/s"`, `path = "/tmp/lfh-x/opt"`, "disable = true",
		`state = "/tmp/lfh-x/run/state"`} {
		if !strings.Contains(cfg, want) {
			t.Errorf("config lacks %q:\n%s", want, cfg)
		}
	}
	c.opts = Options{
		EnableCRI:    true,
		Runtimes:     []Runtime{{Name: "lazyfork", Type: "io.containerd.lazyfork.v1", Options: map[string]any{"SystemdCgroup": false}}},
		ProxyPlugins: []ProxyPlugin{{Name: "lazyfork", Address: "/run/lf.sock", ExportsRoot: "/var/lib/lf"}},
		HostsDir:     "/tmp/lfh-x/hosts",
		ExtraTOML:    "# extra",
	}
	cfg = c.config()
	for _, want := range []string{
		"[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.lazyfork]",
		`runtime_type = "io.containerd.lazyfork.v1"`, "SystemdCgroup = false", `Root = "/tmp/lfh-x/run/runc"`,
		`conf_dir = "/tmp/lfh-x/cni/net.d"`, "[proxy_plugins.lazyfork]", `type = "snapshot"`,
		`root = "/var/lib/lf"`, "# extra",
		"[plugins.'io.containerd.transfer.v1.local']\n    config_path = \"/tmp/lfh-x/hosts\"",
		"[plugins.'io.containerd.cri.v1.images'.registry]\n    config_path = \"/tmp/lfh-x/hosts\"",
	} {
		if !strings.Contains(cfg, want) {
			t.Errorf("config lacks %q:\n%s", want, cfg)
		}
	}
	if strings.Contains(cfg, `"io.containerd.grpc.v1.cri"`) {
		t.Errorf("CRI disabled although EnableCRI")
	}
}
