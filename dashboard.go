package main

import (
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/base64"
	"net/http"
	"regexp"
	"sync"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/redis/go-redis/v9"
	"golang.org/x/sync/singleflight"
)

// dashboardPage is the live dashboard: plain HTML and JavaScript, no build step.
//
//go:embed dashboard.html
var dashboardPage []byte

// handleDashboard is GET / on the API port. Its Content-Security-Policy
// allows exactly the page's own inline <script> and <style> blocks by hash (no
// 'unsafe-inline'), so an injected script or style would not run.
func handleDashboard() echo.HandlerFunc {
	csp := dashboardCSP(dashboardPage)
	return func(c echo.Context) error {
		h := c.Response().Header()
		h.Set("Cache-Control", "no-store")
		h.Set("Content-Security-Policy", csp)
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Referrer-Policy", "no-referrer")
		return c.Blob(http.StatusOK, echo.MIMETextHTMLCharsetUTF8, dashboardPage)
	}
}

var (
	inlineScript = regexp.MustCompile(`(?s)<script>(.*?)</script>`)
	inlineStyle  = regexp.MustCompile(`(?s)<style>(.*?)</style>`)
)

// dashboardCSP builds the policy from the page: the SHA-256 of every inline
// block, so editing the page never needs a hand-kept hash.
func dashboardCSP(page []byte) string {
	hashes := func(re *regexp.Regexp) string {
		var out string
		for _, m := range re.FindAllSubmatch(page, -1) {
			sum := sha256.Sum256(m[1])
			out += " 'sha256-" + base64.StdEncoding.EncodeToString(sum[:]) + "'"
		}
		return out
	}
	return "default-src 'none'; script-src" + hashes(inlineScript) + "; style-src" + hashes(inlineStyle) +
		"; connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
}

// publicPhase is a boot phase as a dashboard viewer sees it: no notes, since
// a phase's note or warning can carry an endpoint or error text.
type publicPhase struct {
	Phase      string       `json:"phase"`
	DurationMs int64        `json:"durationMs"`
	Outcome    phaseOutcome `json:"outcome"`
	Retries    int          `json:"retries"`
}

// clusterCacheTTL is how long one Redis read of the workers and the leader
// answers every /api/instance request: a storm of dashboard polls is then at
// most one SCAN per TTL, not one per request.
const clusterCacheTTL = time.Second

// clusterCache reads the cluster at most once per TTL; concurrent misses
// share one read (single flight).
type clusterCache struct {
	rdb   *redis.Client
	ttl   time.Duration
	group singleflight.Group

	mu     sync.Mutex
	last   cluster
	lastAt time.Time
}

func (cc *clusterCache) get(ctx context.Context) (cluster, error) {
	cc.mu.Lock()
	if !cc.lastAt.IsZero() && time.Since(cc.lastAt) < cc.ttl {
		cl := cc.last
		cc.mu.Unlock()
		return cl, nil
	}
	cc.mu.Unlock()
	v, err, _ := cc.group.Do("cluster", func() (any, error) {
		// The read belongs to every waiter: one client hanging up must not fail the others.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
		cl, err := readCluster(rctx, cc.rdb)
		if err != nil {
			return cluster{}, err
		}
		cc.mu.Lock()
		cc.last, cc.lastAt = cl, time.Now()
		cc.mu.Unlock()
		return cl, nil
	})
	return v.(cluster), err
}

// handleInstance is GET /api/instance, what the dashboard shows, public on the
// API port: this instance's state and boot timeline (phase, duration, outcome,
// retries), the leader's instance id and the live workers (worker name,
// instance id, heartbeat age). Nothing else: no notes, errors, URLs or
// versions; those stay behind the admin token on the ops port.
func handleInstance(lc *Lifecycle, rdb *redis.Client, instanceID string) echo.HandlerFunc {
	cache := &clusterCache{rdb: rdb, ttl: clusterCacheTTL}
	return func(c echo.Context) error {
		cl, err := cache.get(c.Request().Context())
		if err != nil {
			return apiError(http.StatusServiceUnavailable, "unavailable", "the cluster view is unavailable right now")
		}
		timeline := lc.Timeline()
		phases := make([]publicPhase, len(timeline))
		for i, p := range timeline {
			phases[i] = publicPhase{Phase: p.Phase, DurationMs: p.DurationMs, Outcome: p.Outcome, Retries: p.Retries}
		}
		workers := cl.Workers
		if workers == nil {
			workers = []liveWorker{}
		}
		return c.JSON(http.StatusOK, map[string]any{
			"instanceId": instanceID,
			"state":      lc.State().String(),
			"uptimeSec":  int64(lc.Uptime().Seconds()),
			"phases":     phases,
			"leader":     cl.Leader,
			"workers":    workers,
		})
	}
}
