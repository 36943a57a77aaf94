package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/lazyfork/lazyfork/integration/harness"
)

// usernsHostID is the first host ID of the test pods' user namespace (kubelet
// hands out ranges of 65536 at multiples of 65536).
const usernsHostID = 65536 * 7

// TestCRIUserNamespacePod: a pod with its own user namespace (Kubernetes
// hostUsers: false) runs under the lazyfork handler as docs/kubernetes.md
// configures it, and a container in it runs, with root mapped to the pod's
// host range, LazyFork's overcommit hook applied and its memory mount there.
func TestCRIUserNamespacePod(t *testing.T) {
	for _, tc := range []struct {
		name    string
		handler func(bin string) harness.Runtime
	}{
		// The alternative for handlers that need runc's options: runc's
		// runtime type, LazyFork's shim binary.
		{"runc-type-with-lazyfork-path", func(bin string) harness.Runtime {
			return harness.Runtime{
				Name:                 criHandler,
				Type:                 "io.containerd.runc.v2",
				Path:                 filepath.Join(bin, "containerd-shim-lazyfork-v1"),
				PodAnnotations:       []string{"lazyfork.io/*"},
				ContainerAnnotations: []string{"lazyfork.io/*"},
			}
		}},
		// What lazyfork setup writes: LazyFork's runtime type, no [options]
		// (with an [options] table containerd's CRI cannot give a user
		// namespace's task its I/O owner: docs/kubernetes.md).
		{"lazyfork-type-no-options", func(string) harness.Runtime {
			return harness.Runtime{
				Name:                 criHandler,
				Type:                 lfRuntime,
				NoOptions:            true,
				PodAnnotations:       []string{"lazyfork.io/*"},
				ContainerAnnotations: []string{"lazyfork.io/*"},
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := startCRIWith(t, tc.handler(lfBin(t)))
			ctx := c.ctx(t)
			p := c.runUsernsPod(t, ctx, "userns")
			id := c.run(t, ctx, p, p.containerConfig("app", harness.BusyboxImage, []string{"sh", "-c", "echo started; exec sleep 100000"}, nil))
			if _, err := waitLog(ctx, p.logPath("app"), func(l string) bool { return l == "started" }); err != nil {
				t.Fatal(err)
			}
			out, code, err := c.execSync(ctx, id, "sh", "-c", "cat /proc/self/uid_map /proc/sys/vm/overcommit_memory; grep -c ' /.lazyfork/mem ' /proc/self/mounts; id -u")
			if err != nil || code != 0 {
				t.Fatalf("ExecSync: %v (exit %d) %s", err, code, out)
			}
			want := fmt.Sprintf("0 %d 65536 2 1 0", usernsHostID)
			if got := strings.Join(strings.Fields(out), " "); got != want {
				t.Errorf("in the pod: uid_map, overcommit_memory, /.lazyfork/mem mounts, uid = %q, want %q", got, want)
			}
			c.stopRemove(t, ctx, p)
		})
	}
}

// runUsernsPod runs a pod in its own network and user namespace (Kubernetes
// hostUsers: false, as kubelet asks for it): IDs 0..65535 map to
// usernsHostID on. Containers made by p.containerConfig get the same options.
func (c *criEnv) runUsernsPod(t *testing.T, ctx context.Context, name string) *pod {
	t.Helper()
	nw, err := c.AddBridgeNetwork(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := nw.Remove(); err != nil {
			t.Error(err)
		}
	})
	uid := name + "-" + lfRandom(4)
	ids := []*runtimeapi.IDMapping{{HostId: usernsHostID, ContainerId: 0, Length: 65536}}
	cfg := &runtimeapi.PodSandboxConfig{
		Metadata:     &runtimeapi.PodSandboxMetadata{Name: name, Uid: uid, Namespace: "default"},
		Hostname:     name,
		LogDirectory: filepath.Join(c.logDir, uid),
		Labels:       map[string]string{"app": name},
		Linux: &runtimeapi.LinuxPodSandboxConfig{
			CgroupParent: c.CgroupParent + "/pod" + strings.ReplaceAll(uid, "-", ""),
			SecurityContext: &runtimeapi.LinuxSandboxSecurityContext{
				NamespaceOptions: &runtimeapi.NamespaceOption{
					Network:       runtimeapi.NamespaceMode_POD,
					Pid:           runtimeapi.NamespaceMode_CONTAINER,
					Ipc:           runtimeapi.NamespaceMode_POD,
					UsernsOptions: &runtimeapi.UserNamespace{Mode: runtimeapi.NamespaceMode_POD, Uids: ids, Gids: ids},
				},
			},
		},
	}
	if err := os.MkdirAll(cfg.LogDirectory, 0o755); err != nil {
		t.Fatal(err)
	}
	resp, err := c.rt.RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: cfg, RuntimeHandler: criHandler})
	if err != nil {
		t.Fatalf("RunPodSandbox %s (user namespace): %v", name, err)
	}
	return &pod{id: resp.PodSandboxId, cfg: cfg}
}
