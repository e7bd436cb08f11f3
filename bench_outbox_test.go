package main

// Outbox figures, measured, not asserted:
//
//	go test -run '^$' -bench 'Outbox' -benchtime 20000x .
//
// BenchmarkOutboxThroughput/rtt=R/pollers=N   delivered (numbered) events/s
//                                       from a backlog of b.N events by N
//                                       instances, each its own poller and pool,
//                                       at the default settings; rtt=1ms puts
//                                       PostgreSQL one more millisecond away
//                                       (Toxiproxy). Also the box's busy cores
//                                       and the CPU per event of the pollers and
//                                       of PostgreSQL. Run it with -benchtime
//                                       200000x for the figures in docs/delivery.md
// BenchmarkOutboxLatency/notify|poll    commit → SSE client latency at 500 events/s

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2/client"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

func BenchmarkOutboxThroughput(b *testing.B) {
	// rtt=0 is this box as it is: Postgres on the pollers' cores. rtt=1ms
	// puts Postgres one network round trip away through Toxiproxy, as on
	// another host, so a poller waits for it instead of competing for CPU.
	for _, rtt := range []time.Duration{0, time.Millisecond} {
		for _, pollers := range []int{1, 2, 4} {
			b.Run(fmt.Sprintf("rtt=%s/pollers=%d", rtt, pollers), func(b *testing.B) {
				f := newOutboxFixture(b)
				defaults := defaultConfig()
				f.cfg, f.beatEvery = defaults.Outbox, defaults.Heartbeat.Interval
				conn := f.db.Config().ConnString()
				if rtt > 0 {
					conn = behindLatency(b, conn, rtt)
				}
				// The backlog: b.N events, written 1,000 per transaction.
				for written := 0; written < b.N; written += 1000 {
					f.writeEvents(b, min(1000, b.N-written))
				}
				b.ResetTimer()
				start, busy0, own0, pg0 := time.Now(), boxBusy(b), ownCPU(b), postgresCPU(b, f.db)
				for i := range pollers {
					if err := f.instanceAt(b, fmt.Sprint("p", i), conn).Start(context.Background()); err != nil {
						b.Fatal(err)
					}
				}
				f.waitDelivered(b, b.N, 5*time.Minute)
				elapsed, busy, own, pg := time.Since(start), boxBusy(b)-busy0, ownCPU(b)-own0, postgresCPU(b, f.db)-pg0
				b.StopTimer()
				b.ReportMetric(float64(b.N)/elapsed.Seconds(), "events/s")
				// The box's CPU over the run, Postgres included: when the
				// cores are full, more pollers can only share them.
				b.ReportMetric(busy.Seconds()/elapsed.Seconds(), "box-cores-busy")
				b.ReportMetric(float64(own.Microseconds())/float64(b.N), "pollers-cpu-µs/event")
				b.ReportMetric(float64(pg.Microseconds())/float64(b.N), "postgres-cpu-µs/event")
				if rtt == 0 {
					b.ReportMetric(pgbenchTPS(b, f.db.Config().ConnString(), 1), "pgbench-N-c1-tps")
				}
			})
		}
	}
}

// behindLatency puts Toxiproxy between conn's clients and its server, adding
// rtt (whole milliseconds) to every round trip, on the way back, and returns
// the proxied conn.
func behindLatency(b *testing.B, conn string, rtt time.Duration) string {
	b.Helper()
	u, err := url.Parse(conn)
	if err != nil {
		b.Fatal(err)
	}
	proxy := proxyTo(b, testToxiproxy(b), "postgres", u.Host)
	if _, err := proxy.AddToxic("latency", "latency", "downstream", 1, toxiproxy.Attributes{"latency": rtt.Milliseconds()}); err != nil {
		b.Fatal(err)
	}
	return withHost(b, conn, proxy.Listen)
}

// boxBusy is the CPU time the whole machine has spent busy so far (every
// process, every core), from /proc/stat.
func boxBusy(b *testing.B) time.Duration {
	b.Helper()
	stat, err := os.ReadFile("/proc/stat")
	if err != nil {
		b.Skipf("no /proc/stat: %v", err)
	}
	line, _, _ := strings.Cut(string(stat), "\n")
	fields := strings.Fields(line) // cpu user nice system idle iowait irq softirq steal ...
	var ticks int64
	for i, f := range fields[1:] {
		if i == 3 || i == 4 { // idle, iowait
			continue
		}
		if i >= 8 { // guest time is already in user
			break
		}
		n, _ := strconv.ParseInt(f, 10, 64)
		ticks += n
	}
	return time.Duration(ticks) * time.Second / 100 // USER_HZ is 100 on Linux
}

// ownCPU is the CPU time this process (the pollers) has used so far.
func ownCPU(b *testing.B) time.Duration {
	b.Helper()
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// postgresCPU is the CPU time the PostgreSQL server behind db has used so
// far: the postmaster with the children it reaped, and its live children.
// Unlike the box's figure, other work on the machine does not count.
func postgresCPU(b *testing.B, db *pgxpool.Pool) time.Duration {
	b.Helper()
	var backend int
	if err := db.QueryRow(context.Background(), `SELECT pg_backend_pid()`).Scan(&backend); err != nil {
		b.Fatal(err)
	}
	ticks := func(pid, from, to int) (n int64) { // stat fields from..to, 1-based as in proc(5)
		fields := procStat(pid)
		for i := from; i <= to && i-3 < len(fields); i++ {
			v, _ := strconv.ParseInt(fields[i-3], 10, 64)
			n += v
		}
		return n
	}
	self := procStat(backend)
	if self == nil {
		b.Skip("PostgreSQL runs on another machine: its CPU cannot be read")
	}
	postmaster, _ := strconv.Atoi(self[1])
	total := ticks(postmaster, 14, 17) // utime, stime, cutime, cstime
	for _, child := range childPIDs(postmaster) {
		total += ticks(child, 14, 15)
	}
	return time.Duration(total) * time.Second / 100 // USER_HZ
}

// pgbenchTPS runs pgbench -N (TPC-B without the contended updates: one small
// transaction per event is what an unbatched outbox would do) for 3 seconds.
func pgbenchTPS(b *testing.B, conn string, clients int) float64 {
	b.Helper()
	bin, err := exec.LookPath("pgbench")
	if err != nil {
		matches, _ := filepath.Glob("/usr/lib/postgresql/*/bin/pgbench")
		if len(matches) == 0 {
			b.Skip("pgbench not installed")
		}
		bin = matches[len(matches)-1]
	}
	if out, err := exec.Command(bin, "-i", "-q", "-s", "1", conn).CombinedOutput(); err != nil {
		b.Fatalf("pgbench -i: %v\n%s", err, out)
	}
	out, err := exec.Command(bin, "-N", "-c", strconv.Itoa(clients), "-j", strconv.Itoa(clients), "-T", "3", conn).CombinedOutput()
	if err != nil {
		b.Fatalf("pgbench -N: %v\n%s", err, out)
	}
	m := regexp.MustCompile(`tps = ([0-9.]+)`).FindSubmatch(out)
	if m == nil {
		b.Fatalf("no tps in pgbench output:\n%s", out)
	}
	tps, _ := strconv.ParseFloat(string(m[1]), 64)
	return tps
}

func BenchmarkOutboxLatency(b *testing.B) {
	for _, mode := range []string{"notify", "poll"} {
		b.Run(mode, func(b *testing.B) {
			env := fastEnv(b)
			env["KUMIKO_OUTBOX_POLL_INTERVAL"] = "100ms"
			env["KUMIKO_OUTBOX_LISTEN"] = strconv.FormatBool(mode == "notify")
			env["KUMIKO_LOG_FORMAT"] = "json"
			s := startInProcess(b, env)

			received := sync.Map{} // event id → time seen by the SSE client
			// The stream is registered with the hub once its headers are here.
			req, _ := http.NewRequest(http.MethodGet, apiURL(s)+"/api/events", nil)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				b.Fatal(err)
			}
			defer resp.Body.Close()
			go func() {
				sc := bufio.NewScanner(resp.Body)
				for sc.Scan() {
					if id, ok := strings.CutPrefix(sc.Text(), "id: "); ok {
						n, _ := strconv.ParseInt(id, 10, 64)
						received.Store(n, time.Now())
					}
				}
			}()

			// 500 events/s, one per transaction, like 500 writes/s.
			committed := map[int64]time.Time{}
			tick := time.NewTicker(2 * time.Millisecond)
			b.ResetTimer()
			for b.Loop() {
				<-tick.C
				var id int64
				err := pgx.BeginFunc(context.Background(), s.app.db, func(tx pgx.Tx) error {
					var err error
					id, err = writeOutboxEvent(context.Background(), tx, "bench", "1", "bench.tick", map[string]int{"n": 1})
					return err
				})
				if err != nil {
					b.Fatal(err)
				}
				committed[id] = time.Now()
			}
			tick.Stop()
			b.StopTimer()
			// Let the last ones arrive; the check below counts any that did not.
			poll(5*time.Second, 10*time.Millisecond, func() bool {
				for id := range committed {
					if _, ok := received.Load(id); !ok {
						return false
					}
				}
				return true
			})

			var lat []time.Duration
			for id, at := range committed {
				if seen, ok := received.Load(id); ok {
					lat = append(lat, seen.(time.Time).Sub(at))
				}
			}
			if len(lat) < len(committed) {
				b.Fatalf("%d of %d events reached the SSE client", len(lat), len(committed))
			}
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
			b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
		})
	}
}
