package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/meilisearch/meilisearch-go"
	"github.com/minio/minio-go/v7"
	"github.com/riverqueue/river"
)

// The orders demo's jobs. Each worker must be idempotent: River runs a job
// again after a crash.

// indexOrderArgs: order.created → the orders in Meilisearch. One job carries
// the orders of one delivery batch: a search index takes many documents in
// one call as cheaply as one, and River's cost is per job, not per order.
type indexOrderArgs struct {
	OrderIDs []int64 `json:"orderIds"`
}

func (indexOrderArgs) Kind() string { return "indexOrder" }

// writeReceiptArgs: order.created → the sealed receipts of one delivery
// batch's orders, one S3 object per job.
type writeReceiptArgs struct {
	OrderIDs []int64 `json:"orderIds"`
}

func (writeReceiptArgs) Kind() string { return "writeReceipt" }

// reportArgs is one report, on a cron tick or by hand.
type reportArgs struct{ CronRun }

func (reportArgs) Kind() string { return "report" }

// indexOrder puts the orders into the Meilisearch index in one call
// (replacing any earlier copy).
func indexOrder(d workDeps, ctx context.Context, job *river.Job[indexOrderArgs]) error {
	if d.search == nil {
		return nil // search not configured: nothing to index into
	}
	orders, err := loadOrders(ctx, d.db, job.Args.OrderIDs)
	if err != nil {
		return err
	}
	pk := "id"
	ctx, cancel := d.external(ctx)
	defer cancel()
	if _, err := d.search.Index(ordersIndex).AddDocuments(ctx, orders, &meilisearch.DocumentOptions{PrimaryKey: &pk}); err != nil {
		return fmt.Errorf("indexing %d orders: %w", len(orders), err)
	}
	return nil
}

// writeReceipt stores the receipts of the job's orders in S3 as one object,
// sealed with the master key: the object store never sees a customer's order
// in the clear. One object per batch, not per order: an object store charges
// and works per request, and a request per order cost more than the order.
// An order's event is delivered once, in the transaction that inserts this
// job, so each order is in exactly one batch; a retry writes the same object
// again (receiptsName), replaced, never doubled.
func writeReceipt(d workDeps, ctx context.Context, job *river.Job[writeReceiptArgs]) error {
	if d.storage == nil || len(job.Args.OrderIDs) == 0 {
		return nil
	}
	orders, err := loadOrders(ctx, d.db, job.Args.OrderIDs)
	if err != nil {
		return err
	}
	plain, _ := json.Marshal(orders)
	name := receiptsName(orders)
	sealed := d.masterKey.seal(plain, []byte(name))
	ctx, cancel := d.external(ctx)
	defer cancel()
	_, err = d.storage.PutObject(ctx, d.bucket, name, bytes.NewReader(sealed), int64(len(sealed)),
		minio.PutObjectOptions{ContentType: "application/octet-stream", UserMetadata: map[string]string{"Key-Id": d.masterKey.id}})
	if err != nil {
		return fmt.Errorf("writing %s (%d receipts): %w", name, len(orders), err)
	}
	return nil
}

// receiptsName names a batch of receipts by the first and last of its
// orders' internal ids (orders sorted by id): receipts/<first>-<last>.sealed.
// The object holds the orders between them that were delivered together,
// not every one.
func receiptsName(orders []order) string {
	return fmt.Sprintf("receipts/%d-%d.sealed", orders[0].ID, orders[len(orders)-1].ID)
}

// writeReport counts the orders so far and stores the count as
// reports/<scheduled time>.json (the same tick always writes the same object).
func writeReport(d workDeps, ctx context.Context, job *river.Job[reportArgs]) error {
	var orders, pending int64
	err := d.db.QueryRow(ctx, `SELECT (SELECT count(*) FROM orders),
		(SELECT count(*) FROM outbox_events WHERE delivered_at IS NULL AND dead_at IS NULL)`).Scan(&orders, &pending)
	if err != nil {
		return fmt.Errorf("counting for the report: %w", err)
	}
	report, _ := json.Marshal(map[string]any{"scheduledAt": job.Args.ScheduledAt, "manual": job.Args.Manual,
		"orders": orders, "pendingEvents": pending, "fencingToken": job.Args.FencingToken})
	if d.storage == nil {
		d.log.WithField("report", string(report)).Info("report (no S3 configured)")
		return nil
	}
	name := "reports/" + job.Args.ScheduledAt.UTC().Format(time.RFC3339Nano) + ".json"
	ctx, cancel := d.external(ctx)
	defer cancel()
	_, err = d.storage.PutObject(ctx, d.bucket, name, bytes.NewReader(report), int64(len(report)),
		minio.PutObjectOptions{ContentType: "application/json"})
	if err != nil {
		return fmt.Errorf("writing %s: %w", name, err)
	}
	return nil
}

// loadOrders loads the orders with these ids, every one of them: an id
// without its order fails the job (River retries it, then discards it).
func loadOrders(ctx context.Context, db *pgxpool.Pool, ids []int64) ([]order, error) {
	orders, err := collectOrders(db.Query(ctx, `SELECT `+orderColumns+` FROM orders WHERE id = ANY ($1::bigint[]) ORDER BY id`, ids))
	if err != nil {
		return nil, fmt.Errorf("loading %d orders: %w", len(ids), err)
	}
	found := make(map[int64]bool, len(orders))
	for _, o := range orders {
		found[o.ID] = true
	}
	var missing []int64
	for _, id := range ids {
		if !found[id] {
			missing = append(missing, id)
		}
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("loading orders: %v not found", missing)
	}
	return orders, nil
}
