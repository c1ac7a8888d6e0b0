// hftok_ref.mjs TOKENIZER_JSON TOKENIZER_CONFIG_JSON TEXT_FILE OUT_FILE
// The reference encoder: Hugging Face's JavaScript tokenizers encode the
// UTF-8 text file without special tokens; the ids go to OUT_FILE as
// little-endian uint32.
import { readFileSync, writeFileSync } from "node:fs";
import { Tokenizer } from "@huggingface/tokenizers";

const [tokPath, cfgPath, textPath, outPath] = process.argv.slice(2);
const tok = new Tokenizer(JSON.parse(readFileSync(tokPath, "utf8")),
                          JSON.parse(readFileSync(cfgPath, "utf8")));
const text = readFileSync(textPath, "utf8");
const t0 = process.hrtime.bigint();
const ids = tok.encode(text, { add_special_tokens: false }).ids;
const ms = Number(process.hrtime.bigint() - t0) / 1e6;
writeFileSync(outPath, Buffer.from(new Uint32Array(ids).buffer));
console.log(JSON.stringify({ tokens: ids.length, ms }));
