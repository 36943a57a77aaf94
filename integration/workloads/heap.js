// heap.js: a Node.js program holding a heap, for fork tests.
//
// It fills a Buffer of MIB MiB (argv[2], default 100) with a per-page pattern
// and keeps 100,000 small JS objects in an array (V8's own heap, moved by its
// collector), prints `ready` then `tick N` every 100 ms (allocating and
// dropping garbage each tick, so the collector runs).
//
// SIGHUP: `verify ok=0|1 bad=B objs=O marker=V`: every page of the buffer
// holds its pattern (the first 8 bytes of page 0 hold the marker), every
// object its fields. (Node reserves SIGUSR1 for its inspector.)
// SIGUSR2: a new marker into the buffer and an object; `marker value=V`.
"use strict";
const mib = Number(process.argv[2] || 100);
const page = 4096;
const buf = Buffer.alloc(mib << 20);
const pages = buf.length / page;
const word = (p) => (Math.imul(p, 2654435761) ^ 0x5bd1e995) >>> 0;
for (let p = 0; p < pages; p++) {
	for (let o = 8; o < page; o += 4) buf.writeUInt32LE((word(p) + o) >>> 0, p * page + o);
}
const objs = [];
for (let i = 0; i < 100000; i++) objs.push({ i, s: "o" + i, sq: i * i });
let marker = 0n;
buf.writeBigUInt64LE(marker, 0);
objs[0].marker = marker;

let verify = false, mark = false;
process.on("SIGHUP", () => { verify = true; });
process.on("SIGUSR2", () => { mark = true; });
console.log("ready");
let n = 0;
setInterval(() => {
	n++;
	let garbage = [];
	for (let i = 0; i < 2000; i++) garbage.push({ n, i, s: "g" + i });
	garbage = null;
	if (mark) {
		mark = false;
		marker = BigInt(Date.now()) * 1000n + BigInt(process.pid % 1000);
		buf.writeBigUInt64LE(marker, 0);
		objs[0].marker = marker;
		console.log(`marker value=${marker}`);
	}
	if (verify) {
		verify = false;
		let bad = 0;
		for (let p = 0; p < pages; p++) {
			for (let o = 8; o < page; o += 4) if (buf.readUInt32LE(p * page + o) !== ((word(p) + o) >>> 0)) { bad++; break; }
		}
		for (let i = 0; i < objs.length; i++) {
			const x = objs[i];
			if (x.i !== i || x.s !== "o" + i || x.sq !== i * i) { bad++; break; }
		}
		const m = buf.readBigUInt64LE(0);
		if (m !== marker || objs[0].marker !== marker) bad++;
		console.log(`verify ok=${bad === 0 ? 1 : 0} bad=${bad} objs=${objs.length} marker=${m}`);
	}
	console.log(`tick ${n}`);
}, 100);
