// Package kubernetes holds LazyFork's Kubernetes node install
// (lazyfork.yaml, Dockerfile); its test checks the manifest without a
// cluster.
package kubernetes

import (
	"bytes"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// The objects the manifest holds, as far as the test reads them.
type object struct {
	APIVersion string            `yaml:"apiVersion"`
	Kind       string            `yaml:"kind"`
	Metadata   metadata          `yaml:"metadata"`
	Handler    string            `yaml:"handler"`
	Scheduling *scheduling       `yaml:"scheduling"`
	Data       map[string]string `yaml:"data"`
	Spec       *daemonSetSpec    `yaml:"spec"`
}

type metadata struct {
	Name      string            `yaml:"name"`
	Namespace string            `yaml:"namespace"`
	Labels    map[string]string `yaml:"labels"`
}

type scheduling struct {
	NodeSelector map[string]string `yaml:"nodeSelector"`
}

type daemonSetSpec struct {
	Selector struct {
		MatchLabels map[string]string `yaml:"matchLabels"`
	} `yaml:"selector"`
	Template struct {
		Metadata metadata `yaml:"metadata"`
		Spec     podSpec  `yaml:"spec"`
	} `yaml:"template"`
}

type podSpec struct {
	NodeSelector   map[string]string `yaml:"nodeSelector"`
	HostPID        bool              `yaml:"hostPID"`
	InitContainers []container       `yaml:"initContainers"`
	Containers     []container       `yaml:"containers"`
	Volumes        []struct {
		Name     string `yaml:"name"`
		HostPath *struct {
			Path string `yaml:"path"`
		} `yaml:"hostPath"`
		ConfigMap *struct {
			Name string `yaml:"name"`
		} `yaml:"configMap"`
	} `yaml:"volumes"`
}

type container struct {
	Name            string   `yaml:"name"`
	Image           string   `yaml:"image"`
	Command         []string `yaml:"command"`
	SecurityContext *struct {
		Privileged bool `yaml:"privileged"`
	} `yaml:"securityContext"`
	VolumeMounts []struct {
		Name      string `yaml:"name"`
		MountPath string `yaml:"mountPath"`
	} `yaml:"volumeMounts"`
}

// decode reads every document of the manifest (a YAML error fails, and so
// does a field of the wrong type where the structs above read it).
func decode(t *testing.T) []object {
	t.Helper()
	b, err := os.ReadFile("lazyfork.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var objs []object
	dec := yaml.NewDecoder(bytes.NewReader(b))
	for {
		var n yaml.Node
		if err := dec.Decode(&n); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("lazyfork.yaml: %v", err)
		}
		var o object
		if err := n.Decode(&o); err != nil {
			t.Fatalf("lazyfork.yaml document %d: %v", len(objs)+1, err)
		}
		objs = append(objs, o)
	}
	return objs
}

func byKind(t *testing.T, objs []object, kind string) object {
	t.Helper()
	var found []object
	for _, o := range objs {
		if o.Kind == kind {
			found = append(found, o)
		}
	}
	if len(found) != 1 {
		t.Fatalf("lazyfork.yaml has %d %s objects, want 1", len(found), kind)
	}
	return found[0]
}

// TestManifest: the node install is a Namespace, the RuntimeClass of the
// handler `lazyfork setup` writes, the installer script and a DaemonSet that
// runs it, consistently wired.
func TestManifest(t *testing.T) {
	objs := decode(t)
	for i, o := range objs {
		if o.APIVersion == "" || o.Kind == "" || o.Metadata.Name == "" {
			t.Errorf("document %d: apiVersion %q kind %q name %q: all are required", i+1, o.APIVersion, o.Kind, o.Metadata.Name)
		}
	}
	ns := byKind(t, objs, "Namespace")
	rc := byKind(t, objs, "RuntimeClass")
	cm := byKind(t, objs, "ConfigMap")
	ds := byKind(t, objs, "DaemonSet")

	if rc.APIVersion != "node.k8s.io/v1" || rc.Handler != "lazyfork" {
		t.Errorf("RuntimeClass %s %s handler %q: want node.k8s.io/v1, the handler lazyfork setup writes (lazyfork)", rc.APIVersion, rc.Metadata.Name, rc.Handler)
	}
	if ds.APIVersion != "apps/v1" || ds.Spec == nil {
		t.Fatalf("DaemonSet: apiVersion %q, spec %v", ds.APIVersion, ds.Spec)
	}
	for _, o := range []object{cm, ds} {
		if o.Metadata.Namespace != ns.Metadata.Name {
			t.Errorf("%s %s in namespace %q, want %q", o.Kind, o.Metadata.Name, o.Metadata.Namespace, ns.Metadata.Name)
		}
	}
	spec := ds.Spec.Template.Spec
	// The selector selects the template; the RuntimeClass schedules pods
	// only where the DaemonSet installs.
	for k, v := range ds.Spec.Selector.MatchLabels {
		if ds.Spec.Template.Metadata.Labels[k] != v {
			t.Errorf("DaemonSet selector %s=%s does not match its template's labels %v", k, v, ds.Spec.Template.Metadata.Labels)
		}
	}
	if len(ds.Spec.Selector.MatchLabels) == 0 {
		t.Error("DaemonSet has no selector")
	}
	if rc.Scheduling == nil || len(rc.Scheduling.NodeSelector) == 0 {
		t.Fatal("RuntimeClass has no scheduling.nodeSelector: lazyfork pods could land on nodes without LazyFork")
	}
	for k, v := range rc.Scheduling.NodeSelector {
		if spec.NodeSelector[k] != v {
			t.Errorf("RuntimeClass schedules onto %s=%s, the DaemonSet does not install there (nodeSelector %v)", k, v, spec.NodeSelector)
		}
	}
	if !spec.HostPID {
		t.Error("DaemonSet pods need hostPID (the installer enters PID 1's namespaces)")
	}

	// Volumes: every mount names a volume; the installer sees the host's /
	// and the ConfigMap's script, and is privileged.
	vols := map[string]bool{}
	hostRoot := ""
	for _, v := range spec.Volumes {
		vols[v.Name] = true
		if v.HostPath != nil && v.HostPath.Path == "/" {
			hostRoot = v.Name
		}
		if v.ConfigMap != nil && v.ConfigMap.Name != cm.Metadata.Name {
			t.Errorf("volume %s names ConfigMap %s, the manifest's is %s", v.Name, v.ConfigMap.Name, cm.Metadata.Name)
		}
	}
	if len(spec.InitContainers) != 1 {
		t.Fatalf("%d init containers, want the installer", len(spec.InitContainers))
	}
	inst := spec.InitContainers[0]
	if inst.SecurityContext == nil || !inst.SecurityContext.Privileged {
		t.Error("the installer must be privileged (nsenter, systemctl on the host)")
	}
	mounts := map[string]string{}
	for _, c := range append(spec.InitContainers, spec.Containers...) {
		for _, m := range c.VolumeMounts {
			if !vols[m.Name] {
				t.Errorf("container %s mounts volume %s, which the pod does not define", c.Name, m.Name)
			}
			if c.Name == inst.Name {
				mounts[m.Name] = m.MountPath
			}
		}
		if c.Image != inst.Image {
			t.Errorf("container %s image %s, the installer's is %s", c.Name, c.Image, inst.Image)
		}
	}
	if hostRoot == "" || mounts[hostRoot] != "/host" {
		t.Errorf("the installer must see the host's / at /host (the script's HOST): mounts %v", mounts)
	}

	// The script the installer runs is the ConfigMap's, and it parses.
	script, ok := cm.Data["install.sh"]
	if !ok {
		t.Fatalf("ConfigMap %s has no install.sh", cm.Metadata.Name)
	}
	if len(inst.Command) < 2 || filepath.Base(inst.Command[len(inst.Command)-1]) != "install.sh" {
		t.Errorf("installer command %v does not run install.sh", inst.Command)
	}
	if sh, err := exec.LookPath("sh"); err == nil {
		cmd := exec.Command(sh, "-n")
		cmd.Stdin = strings.NewReader(script)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("install.sh does not parse: %v: %s", err, out)
		}
	}
	// It installs every binary the image holds, and the units make install
	// installs.
	df, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range regexp.MustCompile(`bin/([a-z0-9-]+)`).FindAllStringSubmatch(string(df), -1) {
		if !strings.Contains(script, " "+m[1]) {
			t.Errorf("install.sh does not install %s, which the image holds", m[1])
		}
	}
	for _, u := range []string{"lazyfork-snapshotter.service", "containerd.service.d/lazyfork.conf"} {
		if !strings.Contains(script, u) {
			t.Errorf("install.sh does not install the unit %s", u)
		}
		if _, err := os.Stat(filepath.Join("..", "systemd", u)); err != nil {
			t.Errorf("unit %s: %v", u, err)
		}
	}
}
