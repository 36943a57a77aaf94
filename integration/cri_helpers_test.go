package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/lazyfork/lazyfork/integration/harness"
	"github.com/lazyfork/lazyfork/integration/workloads"
)

// criHandler is the RuntimeClass handler the tests configure, as documented in
// docs/kubernetes.md.
const criHandler = "lazyfork"

// criEnv is a private containerd with CRI and the lazyfork handler, driven the
// way kubelet drives it.
type criEnv struct {
	*lfEnv
	rt     runtimeapi.RuntimeServiceClient
	img    runtimeapi.ImageServiceClient
	logDir string
	// archiveDir is the shim's LAZYFORK_ARCHIVE_DIRS.
	archiveDir string
}

func startCRI(t *testing.T) *criEnv {
	t.Helper()
	return startCRIWith(t, harness.Runtime{
		Name:                 criHandler,
		Type:                 lfRuntime,
		PodAnnotations:       []string{"lazyfork.io/*"},
		ContainerAnnotations: []string{"lazyfork.io/*"},
	})
}

// startCRIWith is startCRI with the lazyfork handler configured as handler
// (its Name must be criHandler).
func startCRIWith(t *testing.T, handler harness.Runtime) *criEnv {
	t.Helper()
	// The only directory pods may name checkpoint archives in.
	archiveDir, err := os.MkdirTemp("/tmp", "lfa-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(archiveDir) })
	// The node API the shim asks for a fork-of of a running container.
	api := newNodeAPI(t)
	e := startLF(t, harness.Options{
		Env:       []string{"LAZYFORK_ARCHIVE_DIRS=" + archiveDir, api.Env()},
		EnableCRI: true,
		Runtimes:  []harness.Runtime{handler},
	})
	api.start(t, e.Bin, e.Root)
	ctx := e.ctx(t)
	if _, err := e.ImportCRIImages(ctx, "", "pause", "python", "busybox"); err != nil {
		t.Fatal(err)
	}
	rt, img := e.CRI()
	logDir, err := e.TempDir("pods-")
	if err != nil {
		t.Fatal(err)
	}
	c := &criEnv{lfEnv: e, rt: rt, img: img, logDir: logDir, archiveDir: archiveDir}
	// Pods are removed before the harness's teardown (registered later, runs first).
	t.Cleanup(func() { c.removeAllPods(t) })
	return c
}

func (c *criEnv) removeAllPods(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	resp, err := c.rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
	if err != nil {
		return
	}
	for _, p := range resp.Items {
		if _, err := c.rt.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: p.Id}); err != nil {
			t.Logf("cleanup: stop pod %s: %v", p.Id, err)
		}
		if _, err := c.rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: p.Id}); err != nil {
			t.Logf("cleanup: remove pod %s: %v", p.Id, err)
		}
	}
}

// pod is one pod sandbox and the config kubelet would keep for it.
type pod struct {
	id  string
	cfg *runtimeapi.PodSandboxConfig
}

// runPod runs a pod under the lazyfork handler, in the host network or (with
// hostNet false) in its own network namespace.
func (c *criEnv) runPod(t *testing.T, ctx context.Context, name string, hostNet bool, annotations map[string]string) *pod {
	t.Helper()
	return c.runPodIn(t, ctx, "default", name, hostNet, annotations)
}

// runPodIn is runPod in Kubernetes namespace k8sNS.
func (c *criEnv) runPodIn(t *testing.T, ctx context.Context, k8sNS, name string, hostNet bool, annotations map[string]string) *pod {
	t.Helper()
	uid := name + "-" + lfRandom(4)
	netMode := runtimeapi.NamespaceMode_POD
	if hostNet {
		netMode = runtimeapi.NamespaceMode_NODE
	}
	cfg := &runtimeapi.PodSandboxConfig{
		Metadata:     &runtimeapi.PodSandboxMetadata{Name: name, Uid: uid, Namespace: k8sNS},
		LogDirectory: filepath.Join(c.logDir, uid),
		Annotations:  annotations,
		Labels:       map[string]string{"app": name},
		Linux: &runtimeapi.LinuxPodSandboxConfig{
			CgroupParent: c.CgroupParent + "/pod" + strings.ReplaceAll(uid, "-", ""),
			SecurityContext: &runtimeapi.LinuxSandboxSecurityContext{
				NamespaceOptions: &runtimeapi.NamespaceOption{Network: netMode, Pid: runtimeapi.NamespaceMode_CONTAINER, Ipc: runtimeapi.NamespaceMode_POD},
			},
		},
	}
	if !hostNet {
		cfg.Hostname = name
	}
	if err := os.MkdirAll(cfg.LogDirectory, 0o755); err != nil {
		t.Fatal(err)
	}
	resp, err := c.rt.RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: cfg, RuntimeHandler: criHandler})
	if err != nil {
		t.Fatalf("RunPodSandbox %s: %v", name, err)
	}
	return &pod{id: resp.PodSandboxId, cfg: cfg}
}

// containerConfig is what kubelet sends for a container of p: the pod's
// namespace options copied in, a log path under the pod's log directory.
func (p *pod) containerConfig(name, image string, args []string, annotations map[string]string) *runtimeapi.ContainerConfig {
	return &runtimeapi.ContainerConfig{
		Metadata:    &runtimeapi.ContainerMetadata{Name: name},
		Image:       &runtimeapi.ImageSpec{Image: image},
		Command:     args,
		LogPath:     name + ".log",
		Annotations: annotations,
		// kubelet's labels, by which lazyfork.io/fork-of finds a container.
		Labels: map[string]string{
			"io.kubernetes.pod.name":       p.cfg.Metadata.Name,
			"io.kubernetes.pod.namespace":  p.cfg.Metadata.Namespace,
			"io.kubernetes.pod.uid":        p.cfg.Metadata.Uid,
			"io.kubernetes.container.name": name,
		},
		Linux: &runtimeapi.LinuxContainerConfig{
			SecurityContext: &runtimeapi.LinuxContainerSecurityContext{
				NamespaceOptions: p.cfg.Linux.SecurityContext.NamespaceOptions,
			},
		},
	}
}

func (p *pod) logPath(name string) string { return filepath.Join(p.cfg.LogDirectory, name+".log") }

// create creates a container in the pod (without starting it).
func (c *criEnv) create(ctx context.Context, p *pod, cc *runtimeapi.ContainerConfig) (string, error) {
	resp, err := c.rt.CreateContainer(ctx, &runtimeapi.CreateContainerRequest{PodSandboxId: p.id, Config: cc, SandboxConfig: p.cfg})
	if err != nil {
		return "", err
	}
	return resp.ContainerId, nil
}

// run creates and starts a container in the pod.
func (c *criEnv) run(t *testing.T, ctx context.Context, p *pod, cc *runtimeapi.ContainerConfig) string {
	t.Helper()
	id, err := c.create(ctx, p, cc)
	if err != nil {
		t.Fatalf("CreateContainer %s: %v", cc.Metadata.Name, err)
	}
	if _, err := c.rt.StartContainer(ctx, &runtimeapi.StartContainerRequest{ContainerId: id}); err != nil {
		t.Fatalf("StartContainer %s: %v", cc.Metadata.Name, err)
	}
	return id
}

// criLines reads a CRI container log ("<time> <stream> <P|F> <text>") as the
// program's lines.
func criLines(path string) ([]string, error) {
	raw, err := harness.ReadLines(path)
	if err != nil {
		return nil, err
	}
	out := make([]string, 0, len(raw))
	var partial string
	for _, l := range raw {
		f := strings.SplitN(l, " ", 4)
		if len(f) < 3 {
			continue
		}
		text := ""
		if len(f) == 4 {
			text = f[3]
		}
		if f[2] == "P" {
			partial += text
			continue
		}
		out = append(out, partial+text)
		partial = ""
	}
	return out, nil
}

// waitLog waits for a program line of a CRI log matching match.
func waitLog(ctx context.Context, path string, match func(string) bool) (string, error) {
	for {
		lines, _ := criLines(path)
		for _, l := range lines {
			if match(l) {
				return l, nil
			}
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("%s: no matching line (last lines %q): %w", path, tail(lines, 5), ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func tail(l []string, n int) []string {
	if len(l) > n {
		return l[len(l)-n:]
	}
	return l
}

// ticks returns the counter ticks of a CRI log, in order.
func ticks(path string) []int {
	lines, _ := criLines(path)
	var out []int
	for _, l := range lines {
		if n, ok := workloads.ParseTick(l); ok {
			out = append(out, n)
		}
	}
	return out
}

// waitTickAbove waits for a tick > n in a CRI log and returns it.
func waitTickAbove(ctx context.Context, path string, n int) (int, error) {
	l, err := waitLog(ctx, path, func(l string) bool {
		v, ok := workloads.ParseTick(l)
		return ok && v > n
	})
	if err != nil {
		return 0, err
	}
	v, _ := workloads.ParseTick(l)
	return v, nil
}

// execSync runs argv in a container through CRI.
func (c *criEnv) execSync(ctx context.Context, id string, argv ...string) (string, int32, error) {
	resp, err := c.rt.ExecSync(ctx, &runtimeapi.ExecSyncRequest{ContainerId: id, Cmd: argv, Timeout: 60})
	if err != nil {
		return "", 0, err
	}
	return string(resp.Stdout) + string(resp.Stderr), resp.ExitCode, nil
}

// stopRemove stops and removes a pod like kubelet: containers first.
func (c *criEnv) stopRemove(t *testing.T, ctx context.Context, p *pod) {
	t.Helper()
	cs, err := c.rt.ListContainers(ctx, &runtimeapi.ListContainersRequest{Filter: &runtimeapi.ContainerFilter{PodSandboxId: p.id}})
	if err != nil {
		t.Fatal(err)
	}
	for _, ct := range cs.Containers {
		if _, err := c.rt.StopContainer(ctx, &runtimeapi.StopContainerRequest{ContainerId: ct.Id, Timeout: 5}); err != nil {
			t.Fatalf("StopContainer %s: %v", ct.Metadata.Name, err)
		}
		if _, err := c.rt.RemoveContainer(ctx, &runtimeapi.RemoveContainerRequest{ContainerId: ct.Id}); err != nil {
			t.Fatalf("RemoveContainer %s: %v", ct.Metadata.Name, err)
		}
	}
	if _, err := c.rt.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: p.id}); err != nil {
		t.Fatalf("StopPodSandbox: %v", err)
	}
	if _, err := c.rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: p.id}); err != nil {
		t.Fatalf("RemovePodSandbox: %v", err)
	}
}
