package client

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/containerd/containerd/v2/pkg/oci"
	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// A nerdctl container's state laid out as nerdctl 2.2 lays it out.
func nerdctlParent(t *testing.T) (dataStore string, labels map[string]string, spec *oci.Spec) {
	dataStore = t.TempDir()
	st := filepath.Join(dataStore, "containers", "ns", "p1")
	hosts := filepath.Join(dataStore, "etchosts", "ns", "p1")
	names := filepath.Join(dataStore, "names", "ns")
	for _, d := range []string{st, hosts, names} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	for p, c := range map[string]string{
		filepath.Join(st, "resolv.conf"): "nameserver 10.0.0.1\n", filepath.Join(st, "hostname"): "p1\n",
		filepath.Join(st, "log-config.json"): `{"driver":"json-file"}`, filepath.Join(st, "p1-json.log"): "{}\n",
		filepath.Join(hosts, "hosts"): "127.0.0.1 localhost\n", filepath.Join(names, "nd"): "p1",
	} {
		if err := os.WriteFile(p, []byte(c), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	labels = map[string]string{LabelNerdctlName: "nd", nerdctlStateDir: st, "nerdctl/namespace": "ns",
		nerdctlLogURI: "binary:///usr/local/bin/nerdctl?_NERDCTL_INTERNAL_LOGGING=" + dataStore, "nerdctl/error": "old", "other": "x"}
	spec = &oci.Spec{
		Mounts: []specs.Mount{
			{Destination: "/etc/resolv.conf", Source: filepath.Join(st, "resolv.conf")},
			{Destination: "/etc/hosts", Source: filepath.Join(hosts, "hosts")},
			{Destination: "/proc", Source: "proc"},
		},
		Annotations: map[string]string{LabelNerdctlName: "nd", nerdctlStateDir: st, "nerdctl/namespace": "ns"},
	}
	return dataStore, labels, spec
}

func TestNerdctlFork(t *testing.T) {
	ds, labels, spec := nerdctlParent(t)
	nf, err := prepareNerdctlFork(labels, spec, "p1", "p1-abcd1234", false)
	if err != nil {
		t.Fatal(err)
	}
	st := filepath.Join(ds, "containers", "ns", "p1-abcd1234")
	if nf.labels[LabelNerdctlName] != "nd-abcd1234" || nf.labels[nerdctlStateDir] != st || nf.labels["nerdctl/namespace"] != "ns" {
		t.Errorf("labels %v", nf.labels)
	}
	if _, ok := nf.labels["nerdctl/error"]; ok {
		t.Error("the parent's error label was kept")
	}
	if _, ok := nf.labels["other"]; ok {
		t.Error("a label not nerdctl's was copied")
	}
	if spec.Annotations[LabelNerdctlName] != "nd-abcd1234" || spec.Annotations[nerdctlStateDir] != st {
		t.Errorf("annotations %v", spec.Annotations)
	}
	if spec.Mounts[0].Source != filepath.Join(st, "resolv.conf") || spec.Mounts[1].Source != filepath.Join(ds, "etchosts", "ns", "p1-abcd1234", "hosts") || spec.Mounts[2].Source != "proc" {
		t.Errorf("mounts %+v", spec.Mounts)
	}
	for _, f := range []string{filepath.Join(st, "resolv.conf"), filepath.Join(st, "hostname"), filepath.Join(st, "log-config.json"), spec.Mounts[1].Source} {
		if _, err := os.Stat(f); err != nil {
			t.Errorf("fork's copy: %v", err)
		}
	}
	if _, err := os.Stat(filepath.Join(st, "p1-json.log")); !os.IsNotExist(err) {
		t.Errorf("the parent's log was copied: %v", err)
	}
	if nf.io() == nil {
		t.Error("no log URI")
	}
	// Named: the id is the name.
	_, labels2, spec2 := nerdctlParent(t)
	if nf2, err := prepareNerdctlFork(labels2, spec2, "p1", "twin", true); err != nil || nf2.labels[LabelNerdctlName] != "twin" {
		t.Errorf("named fork: %v %v", nf2, err)
	}

	// Removal: the fork's state and name, never the parent's.
	os.WriteFile(filepath.Join(ds, "names", "ns", "nd-abcd1234"), []byte("p1-abcd1234"), 0o600)
	if err := removeNerdctlState("p1-abcd1234", nf.labels); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{st, filepath.Join(ds, "etchosts", "ns", "p1-abcd1234"), filepath.Join(ds, "names", "ns", "nd-abcd1234")} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("%s left: %v", p, err)
		}
	}
	for _, p := range []string{filepath.Join(ds, "containers", "ns", "p1", "p1-json.log"), filepath.Join(ds, "names", "ns", "nd")} {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("the parent's %s: %v", p, err)
		}
	}
	// A name now held by another container stays.
	if err := releaseNerdctlName(filepath.Join(ds, "names", "ns"), "nd", "p1-abcd1234"); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(ds, "names", "ns", "nd")); string(b) != "p1" {
		t.Errorf("the parent's name: %q", b)
	}
	// State directories not laid out as nerdctl's are not touched.
	if _, err := prepareNerdctlFork(map[string]string{LabelNerdctlName: "x", nerdctlStateDir: "/somewhere/else"}, &oci.Spec{}, "p1", "f", true); err == nil {
		t.Error("a state directory not ending in the id: no error")
	}
}
