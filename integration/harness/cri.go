package harness

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/platforms"
	"google.golang.org/grpc"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// CRINamespace is the containerd namespace of CRI's containers and images.
const CRINamespace = "k8s.io"

// PauseImage is CRI's default sandbox image (containerd's pinned_images.sandbox);
// scripts/images.sh builds it as "pause" since nothing can be pulled here.
const PauseImage = "registry.k8s.io/pause:3.10.2"

// CRI returns clients of containerd's CRI runtime and image services (the
// harness must run with Options.EnableCRI). They share the Go client's connection.
func (c *Containerd) CRI() (runtimeapi.RuntimeServiceClient, runtimeapi.ImageServiceClient) {
	conn := c.Client().Conn().(grpc.ClientConnInterface)
	return runtimeapi.NewRuntimeServiceClient(conn), runtimeapi.NewImageServiceClient(conn)
}

// ImportCRIImages imports the named test images ("busybox", "python", "pause")
// into CRI's namespace and unpacks them into snapshotter ("" = overlayfs,
// CRI's default), building the archives with scripts/images.sh if needed.
// It returns their references in order.
func (c *Containerd) ImportCRIImages(ctx context.Context, snapshotter string, names ...string) ([]string, error) {
	if snapshotter == "" {
		snapshotter = "overlayfs"
	}
	var refs []string
	for _, name := range names {
		ref := PauseImage
		if name != "pause" {
			r, err := ImageRef(name)
			if err != nil {
				return nil, err
			}
			ref = r
		}
		path, err := imageArchive(ctx, name)
		if err != nil {
			return nil, err
		}
		if err := c.importInto(ctx, CRINamespace, path, ref, snapshotter); err != nil {
			return nil, err
		}
		refs = append(refs, ref)
	}
	return refs, nil
}

func (c *Containerd) importInto(ctx context.Context, ns, path, ref, snapshotter string) error {
	ctx = namespaces.WithNamespace(ctx, ns)
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("harness: %w", err)
	}
	defer f.Close()
	cl := c.Client()
	if _, err := cl.Import(ctx, f, client.WithImportPlatform(platforms.Default())); err != nil {
		return fmt.Errorf("harness: import %s into %s: %w", path, ns, err)
	}
	img, err := cl.GetImage(ctx, ref)
	if err != nil {
		return fmt.Errorf("harness: %s not in %s: %w", ref, path, err)
	}
	img = client.NewImageWithPlatform(cl, img.Metadata(), platforms.Default())
	if err := img.Unpack(ctx, snapshotter); err != nil {
		return fmt.Errorf("harness: unpack %s into %s: %w", ref, snapshotter, err)
	}
	return nil
}

// BridgeNetwork is a private CNI bridge network of one harness.
type BridgeNetwork struct {
	Name   string // CNI network name
	Bridge string // Linux bridge device (removed by Remove)
	Subnet string // e.g. 10.231.17.0/24
}

// AddBridgeNetwork writes a CNI network (bridge + host-local, no masquerade,
// a private /24 derived from the harness id) into the harness's CNI conf dir
// and waits until CRI reports its network ready. Call Remove when done.
func (c *Containerd) AddBridgeNetwork(ctx context.Context) (*BridgeNetwork, error) {
	return c.addBridgeNetwork(ctx, false)
}

// AddBridgeNetworkWithPorts is AddBridgeNetwork with CNI's portmap plugin
// chained, so that pods' hostPort mappings work (iptables rules, removed with
// each pod).
func (c *Containerd) AddBridgeNetworkWithPorts(ctx context.Context) (*BridgeNetwork, error) {
	return c.addBridgeNetwork(ctx, true)
}

func (c *Containerd) addBridgeNetwork(ctx context.Context, portmap bool) (*BridgeNetwork, error) {
	h := sha256.Sum256([]byte(c.ID))
	n := &BridgeNetwork{
		Name:   "lfh-" + c.ID,
		Bridge: fmt.Sprintf("lfb%x", h[:4]),
		Subnet: fmt.Sprintf("10.%d.%d.0/24", 200+int(h[4])%50, h[5]),
	}
	conf := map[string]any{
		"cniVersion": "1.0.0",
		"name":       n.Name,
		"plugins": []any{map[string]any{
			"type":      "bridge",
			"bridge":    n.Bridge,
			"isGateway": true,
			"ipMasq":    false,
			"ipam": map[string]any{
				"type":    "host-local",
				"ranges":  [][]map[string]string{{{"subnet": n.Subnet}}},
				"dataDir": filepath.Join(c.Dir, "cni", "ipam"),
			},
		}},
	}
	if portmap {
		conf["plugins"] = append(conf["plugins"].([]any), map[string]any{
			"type":         "portmap",
			"capabilities": map[string]bool{"portMappings": true},
		})
	}
	b, err := json.MarshalIndent(conf, "", "  ")
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(c.Dir, "cni", "net.d")
	tmp := filepath.Join(dir, ".10-lazyfork.conflist.tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return nil, fmt.Errorf("harness: %w", err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, "10-lazyfork.conflist")); err != nil {
		return nil, fmt.Errorf("harness: %w", err)
	}
	rt, _ := c.CRI()
	deadline := time.Now().Add(30 * time.Second)
	for {
		st, err := rt.Status(ctx, &runtimeapi.StatusRequest{})
		if err == nil {
			for _, cond := range st.GetStatus().GetConditions() {
				if cond.Type == runtimeapi.NetworkReady && cond.Status {
					return n, nil
				}
			}
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("harness: CRI network not ready 30 s after writing %s (status %v, %v): %w", n.Name, st, err, errdefs.ErrUnavailable)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// Remove deletes the bridge device (the pods' veths went with their netns).
func (n *BridgeNetwork) Remove() error {
	out, err := exec.Command("ip", "link", "del", n.Bridge).CombinedOutput()
	if err != nil && !strings.Contains(string(out), "Cannot find device") {
		return fmt.Errorf("harness: ip link del %s: %v: %s", n.Bridge, err, out)
	}
	return nil
}
